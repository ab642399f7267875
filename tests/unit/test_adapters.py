"""Adapters as inputs: a PEFT adapter directory to start from (`model.adapter`, or given as
`model.path`), what is refused before anything starts, an adapter export recognised as
rayzero's own on a rerun, and the plan's counts of a LoRA model under tensor parallelism."""

import json

import pytest

from rayzero.checkpoint.export import check_final, write_hf_dir
from rayzero.config import ConfigError, load_config
from rayzero.jobs import cli
from rayzero.jobs.train import adapter_start, resolve_data
from rayzero.models.lora import adapter_settings, read_adapter
from rayzero.models.errors import ModelError
from tests.models import save_hf_model

LORA = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["v_proj", "q_proj"], "modules_to_save": None}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory.mktemp("base") / "llama")


def adapter_dir(path, llama, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({**LORA, "base_model_name_or_path": str(llama), **config}))
    return path


def test_an_adapter_directory_as_model_path_trains_on_from_it_on_its_base(tmp_path, llama, capsys):
    adapter = adapter_dir(tmp_path / "adapter", llama)
    cfg = adapter_start(load_config(None, [f"model.path={adapter}"]))
    m = cfg.model
    assert (m.kind, m.path, m.adapter) == ("hf", str(llama), str(adapter))
    assert (m.lora.r, m.lora.alpha, m.lora.target_modules) == (4, 8, ("q_proj", "v_proj"))
    assert f"model.path {adapter} is a PEFT adapter directory (LoRA r=4 alpha=8 on {llama})" in capsys.readouterr().err
    # the same config each time it is resolved: rerunning the command resumes
    assert adapter_start(load_config(None, [f"model.adapter={adapter}"])) == cfg


def test_settings_set_here_must_agree_with_the_adapter_but_dropout(tmp_path, llama):
    found = read_adapter(str(adapter_dir(tmp_path / "a", llama)))
    given = load_config(None, ["model.lora.r=16"]).model.lora
    with pytest.raises(ModelError, match=r"^model.adapter: model.lora.r 16 here, 4 in the adapter .*; leave "
                                         r"model.lora.r out to take the adapter's$"):
        adapter_settings(found, given)
    assert adapter_settings(found, load_config(None, ["model.lora.dropout=0.1"]).model.lora)["dropout"] == 0.1
    assert adapter_settings(found, load_config(None, ["model.lora.target_modules=q_proj,v_proj"]).model.lora)["r"] == 4
    dora = read_adapter(str(adapter_dir(tmp_path / "dora", llama, use_dora=True)))
    with pytest.raises(ModelError, match="uses PEFT's use_dora=True, which rayzero's LoRA does not train"):
        adapter_settings(dora, None)


def test_what_is_not_an_adapter_or_whose_base_is_not_here_is_refused(tmp_path, llama):
    with pytest.raises(ConfigError, match=r"model.adapter: .* is not a PEFT adapter directory \(no adapter_config"):
        adapter_start(load_config(None, [f"model.adapter={tmp_path}"]))
    gone = adapter_dir(tmp_path / "gone", tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=r"was trained on .*no-such-model, which is not here: give model.path="):
        adapter_start(load_config(None, [f"model.adapter={gone}"]))


def test_a_peft_export_is_recognised_as_rayzeros_own(tmp_path):
    """A rerun rewrites its own adapter export; another model's is refused, as for `hf`."""
    identity = {"kind": "hf", "source": "/m", "config_sha256": "abc"}
    out = tmp_path / "adapter"
    write_hf_dir(str(out), [], {"adapter_config.json": b"{}"}, 10**9, {"rayzero_model": json.dumps(identity)},
                 stem="adapter_model")
    check_final(str(out), "peft", identity, overwrite=False)
    with pytest.raises(ValueError, match="an export of hf model /m"):
        check_final(str(out), "peft", {**identity, "config_sha256": "def"}, overwrite=False)


def test_a_missing_dataset_for_an_hf_model_says_to_prepare_it_with_the_models_tokenizer(tmp_path, llama):
    """A model directory with a tokenizer: the hint names it; one without: the plain hint."""
    import shutil

    from rayzero.data.errors import DataError
    from tests.models import save_tokenizer

    with_tokenizer = tmp_path / "llama-tok"
    shutil.copytree(llama, with_tokenizer)
    save_tokenizer(with_tokenizer, ["def add(a, b):\n    return a + b\n"] * 4)
    cfg = load_config(None, ["model.kind=hf", f"model.path={with_tokenizer}", f"data.path={tmp_path / 'none'}"])
    with pytest.raises(DataError, match=rf"rayzero data prepare SRC .*none --tokenizer {with_tokenizer}`, the model"):
        resolve_data(cfg)
    with pytest.raises(DataError, match=r"rayzero data prepare SRC \S*none`\)$"):
        resolve_data(cfg.override(f"model.path={llama}"))


def test_the_plan_counts_the_whole_model_under_tensor_parallelism(tmp_path, capsys, llama):
    """At tp 2 the parameters and the frozen ones are both the whole model's (one rank's share
    apart), as at tp 1."""
    lora = ["model.kind=hf", f"model.path={llama}", "model.lora.r=4", "model.lora.target_modules=q_proj,v_proj",
            f"train.output_dir={tmp_path}", "train.seq_len=32", "cluster.num_workers=2"]
    plans = {}
    for tp in (1, 2):
        out = tmp_path / f"plan{tp}.json"
        assert cli.main(["train", "--dry-run", "--summary-json", str(out), *lora, f"parallel.tp={tp}"]) == 0
        plans[tp] = json.loads(out.read_text())
    assert (plans[2]["num_params"], plans[2]["trainable_params"]) == (plans[1]["num_params"], plans[1]["trainable_params"])
    assert plans[2]["params_per_rank"] < plans[1]["params_per_rank"]
    frozen = plans[1]["num_params"] - plans[1]["trainable_params"]
    assert f"{plans[1]['num_params']:,} parameters ({frozen:,} frozen) ({plans[2]['params_per_rank']:,} on each rank" \
        in capsys.readouterr().out


def test_help_lists_the_config_keys_and_adapter_directories(capsys):
    for argv in (["train", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
    out = capsys.readouterr().out
    assert "docs/reference/configuration.md" in out and "  model: kind, path, init," in out and "checkpoint: dir," in out
    assert "a PEFT adapter directory" in " ".join(out.split())
