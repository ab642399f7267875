"""The defaults a run takes by how it starts: from pretrained weights (an HF directory with
weights, an adapter) the fine-tuning ones TRL and PEFT publish, full and LoRA apart; from a
config the pretraining ones; a key the user sets always wins; the dry run says which set applies
and why in one line, what sets the run's length, and what the windows cut of the examples (or
that nothing is left to train)."""

from __future__ import annotations

import json

import pytest

from rayzero.config import load_config
from rayzero.data.errors import DataError
from rayzero.jobs.defaults import with_defaults
from rayzero.jobs.plan import plan
from tests.models import save_hf_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("defaults")
    weights = save_hf_model("llama", root / "weights")  # max_position_embeddings 128
    config_only = root / "config"
    config_only.mkdir()
    (config_only / "config.json").write_text((weights / "config.json").read_text())
    return {"weights": str(weights), "config": str(config_only), "root": root}


def test_a_fine_tune_of_pretrained_weights_takes_trls_defaults(dirs):
    cfg, d = with_defaults(load_config(None, ["model.kind=hf", f"model.path={dirs['weights']}"]))
    o = cfg.optim
    assert (o.lr, o.weight_decay, o.beta2, o.warmup_steps, o.schedule, o.final_lr) == (2e-5, 0.0, 0.999, 0, "linear", 0.0)
    assert cfg.train.seq_len == 128  # TRL's max_length 1024, capped by the model's 128 positions
    assert cfg.data.epochs == 3 and d.name == "fine-tuning"
    assert d.line().startswith(f"fine-tuning defaults (model.path {dirs['weights']} holds pretrained weights): "
                               "optim.lr=2e-05, optim.weight_decay=0, optim.beta2=0.999")
    assert d.line().endswith("train.seq_len=128, data.epochs=3; a key you set wins")
    # applied once: the same config when resolved again (a rerun of the command resumes)
    assert with_defaults(cfg)[0] == cfg


def test_lora_and_dpo_take_their_own_learning_rates(dirs):
    lora, d = with_defaults(load_config(None, ["model.kind=hf", f"model.path={dirs['weights']}", "model.lora.r=8"]))
    assert lora.optim.lr == 2e-4 and d.name == "LoRA fine-tuning"
    dpo, _ = with_defaults(load_config(None, ["model.kind=hf", f"model.path={dirs['weights']}", "train.objective=dpo"]))
    assert dpo.optim.lr == 1e-6
    both, _ = with_defaults(load_config(None, ["model.kind=hf", f"model.path={dirs['weights']}", "train.objective=dpo",
                                              "model.lora.r=8"]))
    assert both.optim.lr == 1e-5


def test_a_key_the_user_sets_wins_even_at_the_pretraining_value(dirs):
    cfg, d = with_defaults(load_config(None, ["model.kind=hf", f"model.path={dirs['weights']}", "optim.lr=3e-3",
                                              "train.seq_len=64", "train.steps=20"]))
    assert (cfg.optim.lr, cfg.train.seq_len, cfg.train.steps, cfg.data.epochs) == (3e-3, 64, 20, 0)
    assert cfg.optim.weight_decay == 0.0  # what was left unset still takes the fine-tuning default
    assert "optim.lr" not in d.applied and "data.epochs" not in d.applied  # train.steps set: no epochs either


def test_a_model_from_its_config_keeps_the_pretraining_defaults(dirs):
    for keys, why in [(["model.kind=hf", f"model.path={dirs['config']}"], "holds a config and no weights"),
                      (["model.kind=hf", f"model.path={dirs['weights']}", "model.init=random"], "model.init=random"),
                      ([], "random init"),
                      (["model.kind=hf", f"model.path={dirs['root']}"], "holds no model")]:
        cfg = load_config(None, keys)
        done, d = with_defaults(cfg)
        assert done == cfg and not d.fine_tuning and why in d.line(), keys
        assert (done.optim.lr, done.optim.weight_decay, done.train.seq_len) == (3e-3, 0.1, 128)
        assert d.line().startswith("pretraining defaults (")


def chat_data(root, lengths: list[tuple[int, int]]):
    """Instruction examples in bytes with prompts and responses of the given lengths."""
    from rayzero.data.tokens import prepare

    f = root / "ex.jsonl"
    f.write_text("".join(json.dumps({"prompt": "p" * p, "response": "r" * r}) + "\n" for p, r in lengths))
    prepare(f, str(root / "ex"), instructions=True)
    return str(root / "ex")


def test_the_dry_run_says_the_defaults_the_length_and_what_the_windows_cut(dirs, tmp_path):
    data = chat_data(tmp_path, [(10, 20)] * 30 + [(50, 100), (20, 60)])
    p = plan(load_config(None, ["model.kind=hf", f"model.path={dirs['weights']}", f"data.path={data}",
                                "train.seq_len=64", "checkpoint.dir=", "cluster.num_workers=1"]))
    assert p["defaults"].startswith("fine-tuning defaults (model.path") and "data.epochs=3" in p["defaults"]
    steps = p["steps"]
    assert p["length"] == f"data.epochs=3 ({steps} steps) sets the run's length; the schedule follows it"
    # bytes and an EOS: examples of 151 and 81 tokens, cut to 65
    assert p["cut"] == ("2 of 32 instruction examples are longer than a window (train.seq_len + 1 = 65 tokens) and are "
                        "cut, by up to 86 tokens; train.seq_len=150 keeps every one whole")
    both = plan(load_config(None, ["model.kind=hf", f"model.path={dirs['weights']}", f"data.path={data}",
                                   "train.seq_len=64", "checkpoint.dir=", "cluster.num_workers=1", "train.steps=1",
                                   "data.epochs=1"]))
    assert both["steps"] == 1 and both["length"].startswith("train.steps=1 ends the run before data.epochs=1 (")


def test_instruction_data_whose_every_response_the_window_cuts_is_refused(dirs, tmp_path):
    data = chat_data(tmp_path, [(70, 5), (90, 5), (80, 3)])
    with pytest.raises(DataError, match=r"nothing to train at train.seq_len=32: every one of the 3 instruction examples' "
                                        r"prompts fills the window of train.seq_len \+ 1 = 33 tokens, so no response token "
                                        r"is left \(the shortest prompt is 70 tokens\); train.seq_len=70 keeps a response "
                                        r"token of it, train.seq_len=95 keeps every example whole"):
        plan(load_config(None, [f"data.path={data}", "train.seq_len=32", "checkpoint.dir=", "cluster.num_workers=1"]))


def test_a_resume_whose_epochs_outrun_its_schedule_says_which_wins(capsys):
    """`data.epochs` changed on a resume: the schedule the run started with wins, as for
    `train.steps` (optim.schedule_total=original), and the note names the key that changed."""
    from types import SimpleNamespace

    from rayzero.jobs.preflight import say_resume

    resume = SimpleNamespace(uri="ck/step-000040", step=40, manifest={"schedule": {"total_steps": 60}})
    say_resume(load_config(None, ["train.steps=90"]), resume, "data.epochs=3 (90 steps)")
    err = capsys.readouterr().err
    assert "rayzero: warning: data.epochs=3 (90 steps) runs past the learning-rate schedule this run started with " \
           "(60 steps): the schedule wins (optim.schedule_total=original)" in err
    say_resume(load_config(None, ["train.steps=50"]), resume, "data.epochs=1 (50 steps)")
    assert "rayzero: note: data.epochs=1 (50 steps) ends the run before the learning-rate schedule this run started " \
           "with (60 steps) has decayed: the schedule wins" in capsys.readouterr().err
