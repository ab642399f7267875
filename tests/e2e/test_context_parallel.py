"""Context parallelism through `rayzero train` as a user runs it (the CLI's `main`, on the
session's cluster): the built-in GPT at cp 2 (ring), with validation and checkpoints. Its first
validation loss is the one a run without cp computes; the same command stopped after 2 steps and
run again to 4 ends bitwise on the unbroken run's weights; its step-2 checkpoint resumes at cp 1
(no cp: another attention kernel, the same weights to rounding). The dry run shows the mesh.

The attention itself at cp 2 and 4 (ring and Ulysses, masks, grouped-query heads):
tests/dist/test_context_parallel.py; cp with every strategy, recompute, LoRA and bf16 against the
single-process oracle: tests/dist/test_combinations.py."""

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import cli_in_process

pytestmark = pytest.mark.slow


def test_a_context_parallel_run_validates_resumes_bitwise_and_at_cp_1(
        train_here, small_dataset, tmp_path, capsys, monkeypatch):
    keys = [f"data.path={small_dataset}", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=32",
            "train.global_batch_size=4", "train.micro_batch_size=2", "data.val_fraction=0.05", "train.eval_every=2",
            "train.eval_batches=1", "tracking.enabled=false", "optim.warmup_steps=1",
            "optim.schedule=constant"]  # the same learning rates whether a run is told 2 steps or 4
    cp = [*keys, "cluster.num_workers=2", "parallel.cp=2"]

    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", *cp)
    assert code == 0, err[-3000:]
    assert "mesh: replicate 1 x shard 1 x cp 2 x tp 1 = 2 ranks" in out
    assert "context parallel 2 (ring): each rank holds 1/2 of every sequence's tokens" in out

    code, _, err, straight = train_here(*cp, "train.steps=4", f"train.save_final={tmp_path / 'straight'}",
                                        "checkpoint.dir=", summary="straight.json")
    assert code == 0, err[-3000:]
    code, _, err, whole = train_here(*keys, "cluster.num_workers=1", "checkpoint.dir=", "train.steps=1",
                                     summary="whole.json")
    assert code == 0, err[-3000:]
    assert straight["val_losses"][0][1] == pytest.approx(whole["val_losses"][0][1], rel=1e-6)

    resumed = [*cp, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=2",
               f"train.save_final={tmp_path / 'resumed'}"]
    code, _, err, _ = train_here(*resumed, "train.steps=2", summary="first.json")
    assert code == 0, err[-3000:]
    code, _, err, again = train_here(*resumed, "train.steps=4", summary="again.json")
    assert code == 0, err[-3000:]
    a, b = load_file(tmp_path / "straight"), load_file(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "2 + 2 steps differ from 4"
    assert again["final_loss"] == straight["final_loss"]

    # The cp 2 checkpoint at cp 1: the step-2 commit read on one rank.
    code, _, err, single = train_here(*keys, "cluster.num_workers=1", f"checkpoint.dir={tmp_path / 'ck'}",
                                      "checkpoint.resume=" + str(tmp_path / "ck" / "step-000002"), "train.steps=4",
                                      f"train.save_final={tmp_path / 'single'}", summary="single.json")
    assert code == 0, err[-3000:]
    assert f"resuming from {tmp_path / 'ck' / 'step-000002'} at step 2 of 4" in err
    c = load_file(tmp_path / "single")
    # Within rounding (measured: 7e-8 at most, but the attention's key bias, whose gradient is zero
    # up to rounding and which Adam's normalisation turns into steps of ~1e-6)
    assert all(torch.allclose(c[k], a[k], rtol=1e-5, atol=1e-7 if "qkv.bias" not in k else 1e-5) for k in a)
    assert single["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-5)
