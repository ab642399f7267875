"""The torchrun baselines (DDP, or FSDP2 with `--fsdp2`; gloo) that `vs_torchrun.py` compares rayzero against.

A plain torchrun training script doing what a rayzero rank does, without Ray: the training
step of `plain.py` (the same model, batches, AdamW, clipping and schedule). Rank 0 times every
iteration; each rank records its peak RSS. Rank 0 writes a JSON file with the step times,
the per-step losses and the peak RSS of every rank.

    torchrun --standalone --nproc_per_node 2 benchmarks/torchrun_ddp.py --out ddp.json \\
        [--warmup N] [--fsdp2] [rayzero config overrides, e.g. model.preset=small train.steps=30 ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain import PlainTrainer  # noqa: E402

from rayzero.config import load_config  # noqa: E402
from rayzero.jobs.train import resolve_data  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes the results to")
    ap.add_argument("--warmup", type=int, default=1, help="iterations left out of the printed median")
    ap.add_argument("--fsdp2", action="store_true", help="torch FSDP2 (fully_shard per block) instead of DDP")
    ap.add_argument("overrides", nargs="*", help="rayzero config overrides (key=value)")
    args = ap.parse_args()
    cfg = load_config(None, args.overrides)
    data_path = resolve_data(cfg)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.mesh().size("batch"):
        raise SystemExit(f"torchrun started {world} ranks but the config's data-parallel ranks are {cfg.mesh().size('dp')}")
    trainer = PlainTrainer(cfg, data_path, fsdp2=args.fsdp2)
    step_s, losses = trainer.run(cfg.train.steps)
    peak_rss = [None] * world
    dist.all_gather_object(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        timed = step_s[args.warmup:] or step_s
        result = {"world_size": world, "torch_threads": torch.get_num_threads(), "step_ms": [s * 1e3 for s in step_s],
                  "losses": losses.tolist(), "peak_rss_mib": peak_rss}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"torchrun {'FSDP2' if args.fsdp2 else 'DDP'}: {len(step_s)} steps, median "
              f"{statistics.median(timed) * 1e3:.1f} ms/step after {args.warmup} warmup, final loss {losses[-1]:.4f}; "
              f"wrote {args.out}")
    dist.barrier()
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
