"""The torchrun baseline of `startup.py`: the least a torchrun user's script does before its
first step, with rayzero's GPT.

Builds the same model (`rayzero/models/gpt.py`, the config's preset and seed) on every rank,
wraps it in DDP over gloo, and takes one optimizer step: the config's global batch split over
the ranks, in micro-batches of `train.micro_batch_size` (random token ids: the data is not what
is timed). Rank 0 prints one JSON line with the wall-clock time (`time.time()`) each stage
ended at: imports, process group, model, first step.

    torchrun --standalone --nproc_per_node 2 benchmarks/torchrun_first_step.py [key=value ...]
"""

from __future__ import annotations

import time

began = time.time()

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from rayzero.config import load_config  # noqa: E402
from rayzero.models.gpt import build_model  # noqa: E402


def main() -> None:
    stamps = {"began": began, "imported": time.time()}
    cfg = load_config(None, sys.argv[1:])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stamps["process_group"] = time.time()
    model = DDP(build_model(cfg.model, cfg.block_size, seed=cfg.train.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    stamps["model"] = time.time()
    t = cfg.train
    per_rank = t.global_batch_size // world
    gen = torch.Generator().manual_seed(rank)
    for i in range(per_rank // t.micro_batch_size):
        tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()  # DDP all-reduces every micro-batch's gradients: the simplest script does
    opt.step()
    opt.zero_grad()
    stamps["first_step"] = time.time()
    if rank == 0:
        print(json.dumps({"stamps": stamps, "world_size": world, "loss": loss.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
