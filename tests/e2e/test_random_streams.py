"""Dropout through `rayzero train` (the CLI's `main`, on the session's cluster): one definition of
the random stream (`rayzero/sharding/rng.py`), so what a run draws depends on (seed, step,
micro-batch, mesh coordinates) and nothing else. Activation checkpointing in every mode (split
between the GPT and an HF Llama with attention dropout) ends on the weights of the run without
it, under ZeRO-3 (the strategy whose hooks a recompute passes through). Every strategy x mode,
for these and a user's module, runs on real gloo groups as the actors run them
(tests/dist/test_activation_checkpointing.py); a tensor-parallel run resumed by rerunning its
command, in tests/e2e/test_tensor_parallel.py."""

import pytest
import torch
from safetensors.torch import load_file

from tests.models import save_hf_model

pytestmark = pytest.mark.slow

# Each mode once through the CLI, split between the two models (every strategy x mode, for both
# and a user's module, is tests/dist/test_activation_checkpointing.py's).
MODES = {"gpt": ["none", "full", "every:2"], "llama": ["none", "selective"]}
COMMON = ["cluster.num_workers=2", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
          "train.steps=2", "optim.warmup_steps=1", "tracking.enabled=false", "checkpoint.dir=", "train.eval_every=0"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory.mktemp("llama") / "m", num_hidden_layers=3, attention_dropout=0.1)


def model_keys(name: str, llama_dir) -> list[str]:
    if name == "gpt":
        return ["model.n_layer=3", "model.n_embd=64", "model.n_head=4", "model.dropout=0.1"]
    return ["model.kind=hf", f"model.path={llama_dir}"]


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_recompute_draws_what_the_first_forward_drew(name, train_here, small_dataset, tmp_path, llama_dir):
    """Activation checkpointing (the GPT: `full`, `every:2`; the Llama: `selective`) gives the
    same losses and bitwise the same weights as `none`, with dropout at work: the Llama without
    its attention dropout ends on other weights (so the equality held with dropout drawing)."""
    keys = [f"data.path={small_dataset}", *COMMON, *model_keys(name, llama_dir), "sharding.strategy=optim_grads_params"]
    runs = [(mode, [f"model.activation_checkpointing={mode}"]) for mode in MODES[name]]
    if name == "llama":
        runs.append(("no-dropout", [f"model.path={save_hf_model('llama', tmp_path / 'nodrop', num_hidden_layers=3)}"]))
    got = {}
    for label, extra in runs:
        code, _, err, s = train_here(*keys, *extra, f"train.save_final={tmp_path / label}.safetensors",
                                     summary=f"{label}.json")
        assert code == 0, err[-3000:]
        got[label] = (s["first_loss"], s["final_loss"], weights(tmp_path / f"{label}.safetensors"))
    plain = got["none"]
    for label in [m for m in got if m != "no-dropout"]:
        assert got[label][:2] == plain[:2], (label, got[label][:2], plain[:2])
        assert all(torch.equal(got[label][2][k], v) for k, v in plain[2].items()), label
    if "no-dropout" in got:
        assert not all(torch.equal(got["no-dropout"][2][k], v) for k, v in plain[2].items())
