"""Expert parallelism through `rayzero train` as a user runs it (the CLI's `main`, on the
session's cluster): a Mixtral saved by `save_pretrained` (one tensor per expert on disk) at ep 2
under ZeRO-3. The dry run shows what each rank holds; loaded at ep 2 (each rank reading its
experts' slices) and exported after a step at a learning rate of 1e-30 (no fp32 weight moves), the files are the
ones it read,
bit for bit; the same command stopped after 2 steps and run again to 4 ends bitwise on the
unbroken run's weights; its step-2 checkpoint resumes at ep 1 and ends within rounding of the
ep 2 run (its validation too); the steps report the experts' load and the router's z-loss; `rayzero generate` on the ep 2 checkpoint says what
transformers says from its export.

The dispatch itself (uneven and empty experts, capacity), a module's hook, and ep with every
strategy, pipelines, cp, LoRA and DPO against the single-process oracle:
tests/dist/test_expert_parallel.py, tests/dist/test_combinations.py."""

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import cli_in_process
from tests.models import save_hf_model

pytestmark = pytest.mark.slow


def test_an_expert_parallel_mixtral_exports_what_it_read_resumes_bitwise_and_at_ep_1(
        train_here, small_dataset, tmp_path, capsys, monkeypatch):
    from rayzero.jobs.generate import load_generator

    d = save_hf_model("mixtral", tmp_path / "mixtral", num_hidden_layers=2)
    keys = [f"data.path={small_dataset}", "model.kind=hf", f"model.path={d}", "train.seq_len=32",
            "train.global_batch_size=4", "train.micro_batch_size=2", "tracking.enabled=false", "optim.warmup_steps=1",
            "optim.schedule=constant", "sharding.strategy=optim_grads_params", "data.val_fraction=0.05",
            "train.eval_every=2", "train.eval_batches=1", "moe.router_z_loss=0.001"]
    ep = [*keys, "cluster.num_workers=2", "parallel.ep=2"]

    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", *ep)
    assert code == 0, err[-3000:]
    assert "mesh: replicate 1 x shard 1 x ep 2 x tp 1 = 2 ranks" in out
    assert "expert parallel 2: each rank holds 2 of the 4 experts of every MoE layer" in out

    code, _, err, _ = train_here(*ep, "train.steps=1", "optim.lr=1e-30", "optim.min_lr=1e-31", "checkpoint.dir=",
                                 f"train.save_final={tmp_path / 'same'}", "train.save_format=hf", summary="same.json")
    assert code == 0, err[-3000:]
    original, exported = load_file(d / "model.safetensors"), load_file(tmp_path / "same" / "model.safetensors")
    assert exported.keys() == original.keys() and "model.layers.0.block_sparse_moe.experts.3.w2.weight" in exported
    assert all(torch.equal(exported[k], v) for k, v in original.items()), "read by range and exported: not the same"

    hf = "train.save_format=hf"  # exports transformers loads: one tensor per expert, as the files it read
    code, _, err, straight = train_here(*ep, "train.steps=4", f"train.save_final={tmp_path / 'straight'}", hf,
                                        "checkpoint.dir=", summary="straight.json")
    assert code == 0, err[-3000:]
    load = straight["final_expert_load"]
    assert load["expert_load_max_over_mean"] >= 1.0 and load["dropped_pairs"] == 0
    resumed = [*ep, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=2",
               f"train.save_final={tmp_path / 'resumed'}", hf]
    code, _, err, _ = train_here(*resumed, "train.steps=2", summary="first.json")
    assert code == 0, err[-3000:]
    code, out, err, again = train_here(*resumed, "train.steps=4", summary="again.json")
    assert code == 0, err[-3000:]
    assert f"router load-balancing loss {again['final_router_aux_loss']:.4f}, z-loss " in out + err
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "2 + 2 steps differ from 4"
    assert again["final_loss"] == straight["final_loss"]
    assert straight["final_router_z_loss"] > 0 and again["final_router_z_loss"] == straight["final_router_z_loss"]
    assert [v[0] for v in straight["val_losses"]] == [-1, 1, 3] and again["val_losses"][-1] == straight["val_losses"][-1]

    code, _, err, single = train_here(*keys, "cluster.num_workers=1", f"checkpoint.dir={tmp_path / 'ck'}",
                                      "checkpoint.resume=" + str(tmp_path / "ck" / "step-000002"), "train.steps=4",
                                      f"train.save_final={tmp_path / 'single'}", hf, summary="single.json")
    assert code == 0, err[-3000:]
    assert f"resuming from {tmp_path / 'ck' / 'step-000002'} at step 2 of 4" in err
    c = load_file(tmp_path / "single" / "model.safetensors")
    assert c.keys() == a.keys() and all(torch.allclose(c[k], a[k], rtol=1e-5, atol=1e-6) for k in a)
    assert single["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-5)
    assert single["val_losses"][-1][1] == pytest.approx(straight["val_losses"][-1][1], rel=1e-5)

    # the ep 2 checkpoint generates what transformers generates from its export
    prompt = "import json\n"
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(tmp_path / "ck"), "--prompt", prompt,
                                    "--max-new-tokens", "8", "--raw")
    assert code == 0, err[-2000:]
    assert out == prompt + load_generator(str(tmp_path / "resumed"))(prompt, max_new_tokens=8, chat=False) + "\n"
