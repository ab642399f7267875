"""Checks only a GPU can make: NCCL process groups and a sharded step on CUDA (skipped on CPU).

Run them all with `python benchmarks/gpu_checks.py`.
"""

import pytest
import torch

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.workers.rank import Rank
from tests.conftest import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_one_rank_trains_on_cuda_over_nccl(strategy, small_dataset):
    cfg = load_config(None, ["cluster.num_workers=1", "cluster.use_gpu=true", f"sharding.strategy={strategy}",
                             "train.steps=20", "optim.warmup_steps=2"])
    rank = Rank(cfg, 0, 1, small_dataset)
    info = rank.setup("127.0.0.1", free_port())
    assert info["backend"] == "nccl" and info["device"].startswith("cuda")
    losses = []
    for step in range(cfg.train.steps):
        out = rank.iteration({"step": step, "lr": lr_at(step, cfg.train.steps, cfg.optim)})
        losses.append(out["loss_sum"] / out["tokens"])
    assert all(p.is_cuda for p in rank.model.parameters())
    assert rank.strategy.buffer.param_data.is_cuda
    assert losses[-1] < losses[0] - 0.5
    rank.close()
