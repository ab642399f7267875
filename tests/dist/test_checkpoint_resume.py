"""Checkpoints on real gloo groups: bitwise resume, and a reshard chain across world sizes and
strategies that continues the unbroken run's losses."""

import pytest
import torch

from rayzero.checkpoint.manifest import open_checkpoint
from tests.dist.ckpt_helpers import config, run


@pytest.mark.parametrize("world, strategy", [(2, "optim"), pytest.param(2, "optim_grads_params", marks=pytest.mark.slow),
                                             pytest.param(3, "no_shard", marks=pytest.mark.slow)])
def test_resume_is_bitwise_identical(tmp_path, small_dataset, world, strategy):
    root = str(tmp_path / "ckpt")
    cfg = config(world, strategy, root)
    straight = run(cfg, small_dataset, 0, 20)
    first = run(cfg, small_dataset, 0, 10, save_at=10)
    c = open_checkpoint(first["committed"])
    assert c.step == 10
    resumed = run(cfg, small_dataset, 10, 20, resume=(c.uri, c.manifest))
    assert resumed["losses"] == straight["losses"][10:]
    for name, ref in straight["state"].items():
        assert torch.equal(resumed["state"][name], ref), name


@pytest.mark.slow
def test_resume_is_bitwise_identical_through_s3(small_dataset, s3_server):
    cfg = config(2, "optim_grads", "s3://ckpt/bitwise", extra=s3_server.overrides())
    straight = run(cfg, small_dataset, 0, 20)
    first = run(cfg, small_dataset, 0, 10, save_at=10)
    assert first["committed"] == "s3://ckpt/bitwise/step-000010"
    c = open_checkpoint(first["committed"], cfg.checkpoint)
    resumed = run(cfg, small_dataset, 10, 20, resume=(c.uri, c.manifest))
    assert resumed["losses"] == straight["losses"][10:]
    assert all(torch.equal(resumed["state"][k], v) for k, v in straight["state"].items())


CHAIN = [(4, "optim_grads_params"), (2, "optim"), (3, "optim_grads"), (1, "no_shard")]


@pytest.mark.slow
def test_reshard_chain_continues_the_unbroken_run(tmp_path, small_dataset):
    """4 x ZeRO-3 -> 2 x ZeRO-1 -> 3 x ZeRO-2 -> 1 x DDP, five steps each, each resuming
    from the last one's checkpoint, with dropout 0.1: the losses follow an unbroken 20-step run
    (1e-5: fp32 sums in another order), and the final weights match it to 1e-5. Each micro-batch
    draws its masks by its place in the global batch, whatever the world size (`sharding/rng.py`),
    so each world size draws what the unbroken run drew."""
    dropout = ["model.dropout=0.1"]
    unbroken = run(config(1, "no_shard", str(tmp_path / "unused"), dropout), small_dataset, 0, 20)
    losses, resume = [], None
    for i, (world, strategy) in enumerate(CHAIN):
        cfg = config(world, strategy, str(tmp_path / f"ckpt{i}"), dropout)
        last = 5 * (i + 1)
        got = run(cfg, small_dataset, 5 * i, last, save_at=last if last < 20 else None, resume=resume)
        losses += got["losses"]
        if got["committed"]:
            c = open_checkpoint(got["committed"])
            assert c.manifest["layout"]["world_size"] == world and c.manifest["layout"]["strategy"] == strategy
            resume = (c.uri, c.manifest)
    assert losses == pytest.approx(unbroken["losses"], rel=1e-5)
    for name, ref in unbroken["state"].items():
        err = ((got["state"][name] - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (name, err)
