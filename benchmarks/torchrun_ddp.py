"""The torchrun baselines (DDP, or FSDP2 with `--fsdp2`; gloo) that `vs_torchrun.py` compares rayzero against.

A plain torchrun training script doing what a rayzero rank does, without Ray: the same model
(the GPT from `build_model` under the config's seed, or with `model.kind=hf` the HF model
loaded by `from_pretrained` from `model.path`), the same rows of every step's global batch
(`RankBatches` with dp_rank = this rank), the same loss scaling, AdamW with weight decay on
matrices only, gradient clipping and learning-rate schedule. Gradients are all-reduced by
DDP once per step (`no_sync()` on every micro-batch but the last). With `--fsdp2`, torch's
FSDP2 instead: `fully_shard` on each transformer block (an HF model's `_no_split_modules`
class, its decoder layer), then on the whole model (the embeddings, final norm and head as
the root unit), which reduce-scatters gradients on
every micro-batch, as rayzero's ZeRO-3 does. Rank 0 times every
iteration; each rank records its peak RSS. Rank 0 writes a JSON file with the step times,
the per-step losses and the peak RSS of every rank.

    torchrun --standalone --nproc_per_node 2 benchmarks/torchrun_ddp.py --out ddp.json \\
        [--warmup N] [--fsdp2] [rayzero config overrides, e.g. model.preset=small train.steps=30 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.data.batches import RankBatches
from rayzero.data.tokens import TokenDataset
from rayzero.jobs.train import resolve_data
from rayzero.models.gpt import build_model


def plain_model(cfg):
    """The model as a user builds it without rayzero, and its transformer blocks."""
    if cfg.model.kind == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
        units = set(model._no_split_modules)
        return model, [m for m in model.modules() if type(m).__name__ in units]
    model = build_model(cfg.model, cfg.block_size, cfg.train.seed)
    return model, list(model.blocks)


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
    if world != cfg.dp_size:
        raise SystemExit(f"torchrun started {world} ranks but cluster.num_workers is {cfg.dp_size}")
    model, blocks = plain_model(cfg)
    if args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = DDP(model)
    o = cfg.optim
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    data = RankBatches(
        TokenDataset(data_path),
        seed=cfg.train.seed,
        global_batch=cfg.train.global_batch_size,
        micro_batch=cfg.train.micro_batch_size,
        seq_len=cfg.train.seq_len,
        dp_rank=rank,
        dp_size=world,
    )
    # rayzero sums gradients over ranks of a loss divided by the global batch's tokens; DDP
    # averages them, so each rank's loss is scaled by the world size to give the same gradient.
    loss_scale = world / data.tokens_per_step

    step_s, loss_sums = [], []
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.train.steps, o)
        micro = data.microbatches(step)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last or args.fsdp2 else ddp.no_sync()
            with sync:
                out = ddp(x)
                logits = getattr(out, "logits", out)  # an HF model's output object
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
                (loss * loss_scale).backward()
            loss_sum += loss.detach()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        loss_sums.append(loss_sum)

    # Losses are reduced once, after the timed loop, so that no extra collective runs per step.
    losses = torch.stack(loss_sums)
    dist.all_reduce(losses)
    losses /= data.tokens_per_step
    peak_rss = [None] * world
    dist.all_gather_object(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        timed = step_s[args.warmup:] or step_s
        result = {
            "world_size": world,
            "torch_threads": torch.get_num_threads(),
            "step_ms": [s * 1e3 for s in step_s],
            "losses": losses.tolist(),
            "peak_rss_mib": peak_rss,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"torchrun {'FSDP2' if args.fsdp2 else 'DDP'}: {len(step_s)} steps, median {statistics.median(timed) * 1e3:.1f} ms/step "
              f"after {args.warmup} warmup, final loss {losses[-1]:.4f}; wrote {args.out}")

    dist.barrier()
    # Drop everything holding tensors or the mesh before the group goes: otherwise gloo's
    # threads can still be running at interpreter exit and the process aborts.
    del ddp, model, optimizer, groups
    if args.fsdp2:
        del mesh
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
