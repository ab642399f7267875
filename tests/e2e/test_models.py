"""Users' own models through the CLI on real Ray: an HF Llama fine-tuned from its
pretrained weights and exported back to a directory transformers loads; a module from the
user's working directory. (A class defined where `Trainer` is called, as in a notebook cell:
the README's own example, run by test_examples.py.)"""

import json
import textwrap
import warnings

import pytest
import torch
from safetensors.torch import load_file

from rayzero.config import load_config
from tests.conftest import cli_in_process
from tests.dist.reference import global_rows
from tests.e2e.conftest import leftovers, run_cli
from tests.models import save_hf_model, save_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
FAST = ["train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = save_hf_model("llama", tmp_path_factory.mktemp("models") / "tiny-llama")
    save_tokenizer(d, ["import os\nprint(os.getcwd())\n" * 10])
    return d


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory, llama):
    """The stdlib's `json` and `email` sources, tokenized with the model's own tokenizer through the CLI."""
    import sys
    from pathlib import Path

    texts = tmp_path_factory.mktemp("texts")
    for pkg in ("json", "email"):
        for f in sorted((Path(sys.modules["json"].__file__).parent.parent / pkg).glob("*.py")):
            (texts / f"{pkg}_{f.name}").write_text(f.read_text())
    out = tmp_path_factory.mktemp("data") / "llama-tokens"
    r = run_cli("data", "prepare", str(texts), str(out), "--tokenizer", str(llama), "--glob", "*.py", cwd=texts)
    assert r.returncode == 0, r.stderr
    assert "tokenizer tiny-llama" in r.stdout
    return str(out)


def logits(directory, x):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(directory))
    with torch.no_grad():
        return model(input_ids=x).logits


def test_fine_tune_an_hf_llama_export_and_load_it_back(tmp_path, small_dataset, llama, llama_data, capsys,
                                                       monkeypatch, train_here):
    import transformers as tf

    def rayzero(*argv):  # the CLI's `main`, in this process
        return cli_in_process(capsys, monkeypatch, tmp_path, *argv)

    model = ["model.kind=hf", f"model.path={llama}"]
    code, out, err = rayzero("train", "--dry-run", *model)
    assert code == 0, err
    assert f"model LlamaForCausalLM from {llama} (pretrained weights)" in out
    assert "28,832 parameters" in out

    # bytes are not this model's tokens
    code, _, err = rayzero("train", *model, *FAST, f"data.path={small_dataset}")
    assert code == 2 and "was tokenized with bytes, not with the tokenizer of model.path" in err

    final = tmp_path / "final"
    code, _, err, s = train_here(*model, *FAST, f"data.path={llama_data}", "train.steps=6", "checkpoint.every_steps=3",
                                 "sharding.strategy=optim_grads_params", f"train.save_final={final}",
                                 "train.save_format=hf", "tracking.enabled=false")
    assert code == 0, err[-3000:]
    assert s["num_params"] == 28_832 and s["steps"] == 6

    # The first reported loss is the pretrained model's own loss on that batch.
    cfg = load_config(None, [*model, *FAST, f"data.path={llama_data}"])
    rows = global_rows(cfg, llama_data, 0)
    own = torch.nn.functional.cross_entropy(logits(llama, rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
    assert s["first_loss"] == pytest.approx(own.item(), rel=1e-5)

    # The final weights as a directory, and the checkpoint exported as one: both load with
    # from_pretrained, with the tokenizer, and give the same logits as rayzero's own weights.
    exported = tmp_path / "exported"
    code, _, err = rayzero("ckpt", "export", str(tmp_path / "runs" / "checkpoints"), str(exported), "--format", "hf",
                           "--max-shard-size", "50KB")
    assert code == 0, err
    assert len(list(exported.glob("model-*.safetensors"))) > 1
    flat = tmp_path / "flat.safetensors"
    code, _, err = rayzero("ckpt", "export", str(tmp_path / "runs" / "checkpoints"), str(flat))
    assert code == 0, err
    plain = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(str(llama)))
    plain.load_state_dict(load_file(str(flat)))
    with torch.no_grad():
        want = plain(input_ids=rows[:, :-1]).logits
    for directory in (final, exported):
        assert torch.equal(logits(directory, rows[:, :-1]), want), directory
        assert (directory / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()
        tf.AutoTokenizer.from_pretrained(str(directory))
    assert not torch.equal(want, logits(llama, rows[:, :-1])), "training changed the model"


def test_lora_fine_tune_through_ray_exports_the_adapter_peft_loads_and_generate_uses(
        tmp_path, llama, llama_data, capsys, monkeypatch, train_here):
    """LoRA under ZeRO-3 on the cluster: only the adapters train; `train.save_format=peft`
    writes an adapter directory that PEFT loads onto the base, giving the logits of the
    checkpoint's merged export; `rayzero generate` takes the adapter directory, and refuses it
    over another base model."""
    import transformers as tf
    from peft import PeftModel

    def rayzero(*argv):
        return cli_in_process(capsys, monkeypatch, tmp_path, *argv)

    model = ["model.kind=hf", f"model.path={llama}", "model.lora.r=4", "model.lora.alpha=8",
             "model.lora.target_modules=q_proj,v_proj,down_proj",
             "optim.schedule=constant"]  # (a fine-tune's linear decay to 0 would leave the resumed steps at lr 0)
    adapter = tmp_path / "adapter"
    code, _, err, s = train_here(*model, *FAST, f"data.path={llama_data}", "train.steps=4", "checkpoint.every_steps=4",
                                 "optim.lr=1e-2", "sharding.strategy=optim_grads_params",
                                 f"train.save_final={adapter}", "train.save_format=peft", "tracking.enabled=false")
    assert code == 0, err[-3000:]
    # r=4 on two layers' q_proj (32 -> 32), v_proj (32 -> 16) and down_proj (64 -> 32): r x (in + out) each
    assert s["trainable_params"] == 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32))
    assert s["num_params"] == 28_832 + s["trainable_params"]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}
    assert (adapter / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes(), "the base's tokenizer"

    merged = tmp_path / "merged"
    code, out, err = rayzero("ckpt", "export", str(tmp_path / "runs" / "checkpoints"), str(merged), "--format", "hf")
    assert code == 0 and "(a Hugging Face directory)" in out, err
    x = global_rows(load_config(None, [*model, *FAST]), llama_data, 0)[:2, :-1]
    base = tf.AutoModelForCausalLM.from_pretrained(str(llama))
    with torch.no_grad():
        tuned = PeftModel.from_pretrained(base, str(adapter))(input_ids=x).logits
    want = logits(merged, x)
    assert ((tuned - want).norm() / want.norm()).item() < 1e-5
    assert not torch.allclose(want, logits(llama, x)), "training changed the model"

    with warnings.catch_warnings(record=True) as said:  # what a user would see printed: pytest collects them
        warnings.simplefilter("always")
        code, out, err = rayzero("generate", str(adapter), "--prompt", "import os", "--max-new-tokens", "8", "--raw")
    assert not [w for w in said if issubclass(w.category, FutureWarning)], [str(w.message) for w in said]
    assert code == 0, err
    code, from_merged, err = rayzero("generate", str(merged), "--prompt", "import os", "--max-new-tokens", "8", "--raw")
    assert code == 0 and out == from_merged and out.startswith("import os"), (out, from_merged)
    code, from_checkpoint, err = rayzero("generate", str(tmp_path / "runs" / "checkpoints"), "--prompt", "import os",
                                         "--max-new-tokens", "8", "--raw")
    assert code == 0 and from_checkpoint == out, (from_checkpoint, err)

    other = save_hf_model("llama", tmp_path / "other", num_hidden_layers=3)
    code, _, err = rayzero("generate", str(adapter), "--prompt", "x", f"model.path={other}")
    assert code == 2 and f"the adapter was trained on {llama} (config" in err, err
    assert f"not on model.path {other} (config" in err, err

    # The same command with more steps resumes and rewrites its own adapter export
    before = (adapter / "adapter_model.safetensors").read_bytes()
    code, _, err, s = train_here(*model, *FAST, f"data.path={llama_data}", "train.steps=6", "checkpoint.every_steps=4",
                                 "optim.lr=1e-2", "sharding.strategy=optim_grads_params",
                                 f"train.save_final={adapter}", "train.save_format=peft", "tracking.enabled=false")
    assert code == 0 and s["steps"] == 2, err[-3000:]
    assert (adapter / "adapter_model.safetensors").read_bytes() != before

    # The adapter directory as model.path: training goes on from its adapters, on its base
    code, _, err, s = train_here(f"model.path={adapter}", *FAST, f"data.path={llama_data}", "train.steps=2",
                                 "checkpoint.dir=from-adapter", "tracking.enabled=false")
    assert code == 0, err[-3000:]
    assert f"model.path {adapter} is a PEFT adapter directory (LoRA r=4 alpha=8 on {llama})" in err
    assert s["trainable_params"] == 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32))


MYMODEL = '''
import torch.nn as nn


class Bigram(nn.Module):
    """The smallest language model: each token's logits from an embedding of it."""

    def __init__(self, vocab=320, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x).relu()
        return self.head(x)
'''


def test_a_module_from_the_working_directory_trains_on_a_cluster(tmp_path, ray_cluster, small_dataset):
    (tmp_path / "mymodel.py").write_text(textwrap.dedent(MYMODEL))
    weights = tmp_path / "final.safetensors"
    r = run_cli("train", "model.kind=module", "model.factory=mymodel:Bigram", "model.kwargs.dim=24", *FAST,
                f"data.path={small_dataset}", f"cluster.address={ray_cluster}", "train.steps=20",
                "optim.lr=1e-2", "sharding.strategy=optim_grads_params", f"train.save_final={weights}",
                "tracking.enabled=false", "--summary-json", str(tmp_path / "s.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["final_loss"] < s["first_loss"] - 0.5
    assert s["num_params"] == 320 * 24 + 2 * (24 * 24 + 24) + 24 * 320 + 320
    state = load_file(str(weights))
    assert state["emb.weight"].shape == (320, 24) and set(state) == {
        "emb.weight", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias", "head.weight",
        "head.bias"}
    assert leftovers(ray_cluster) == ([], [])


def test_a_mixture_of_experts_fine_tunes_with_its_router_loss_reported_apart(tmp_path, small_dataset, train_here):
    """A Mixtral saved by `save_pretrained` (one tensor per expert on disk) through the CLI: its
    router's load-balancing loss goes to MLflow and the summary beside the token loss, and the
    export is in transformers' layout again."""
    from mlflow.tracking import MlflowClient

    d = save_hf_model("mixtral", tmp_path / "mixtral")
    code, out, err, s = train_here("model.kind=hf", f"model.path={d}", *FAST, f"data.path={small_dataset}",
                                   "train.steps=3", "checkpoint.dir=", "sharding.strategy=optim_grads_params",
                                   f"train.save_final={tmp_path / 'final'}", "train.save_format=hf",
                                   f"train.output_dir={tmp_path / 'runs'}")
    assert code == 0, err
    assert s["final_router_aux_loss"] > 0 and f"router load-balancing loss {s['final_router_aux_loss']:.4f}" in out
    history = MlflowClient(s["mlflow_tracking_uri"]).get_metric_history(s["mlflow_run_id"], "router_aux_loss")
    assert sorted(m.step for m in history) == [0, 1, 2]
    original, exported = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "final" / "model.safetensors"))
    assert exported.keys() == original.keys() and "model.layers.0.block_sparse_moe.experts.3.w2.weight" in exported
