"""Dropout through `rayzero train` (the CLI's `main`, on the session's cluster): one definition of
the random stream (`rayzero/sharding/rng.py`), so what a run draws depends on (seed, step,
micro-batch, mesh coordinates) and nothing else. Activation checkpointing (`full` and
`selective`) ends on the weights of the run without it, under ZeRO-3 (the strategy whose hooks a
recompute passes through), with the GPT's dropout at work. Each mode, for the GPT, an HF Llama
with attention dropout and a user's module, with dropout and without, runs on real gloo groups
as the actors run them (tests/dist/test_activation_checkpointing.py); every mode against plain
torch with the other axes, in tests/dist/test_combinations.py; a tensor-parallel run resumed by
rerunning its command, in tests/e2e/test_tensor_parallel.py."""

import pytest
import torch
from safetensors.torch import load_file


pytestmark = pytest.mark.slow

MODES = ["none", "full", "selective"]
COMMON = ["cluster.num_workers=2", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
          "train.steps=2", "optim.warmup_steps=1", "tracking.enabled=false", "checkpoint.dir=", "train.eval_every=0"]


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def test_recompute_draws_what_the_first_forward_drew(train_here, small_dataset, tmp_path):
    """Activation checkpointing (`full`, `selective`) gives the same losses and bitwise the same
    weights as `none`, the GPT's dropout drawing in every forward and every recompute."""
    keys = [f"data.path={small_dataset}", *COMMON, "model.n_layer=3", "model.n_embd=64", "model.n_head=4",
            "model.dropout=0.1", "sharding.strategy=optim_grads_params"]
    got = {}
    for mode in MODES:
        code, _, err, s = train_here(*keys, f"model.activation_checkpointing={mode}",
                                     f"train.save_final={tmp_path / mode}.safetensors", summary=f"{mode}.json")
        assert code == 0, err[-3000:]
        got[mode] = (s["first_loss"], s["final_loss"], weights(tmp_path / f"{mode}.safetensors"))
    plain = got["none"]
    for mode in MODES[1:]:
        assert got[mode][:2] == plain[:2], (mode, got[mode][:2], plain[:2])
        assert all(torch.equal(got[mode][2][k], v) for k, v in plain[2].items()), mode
