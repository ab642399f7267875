"""gloo's bucket collectives as rayzero runs them against torch's own, side by side in one run.

A strategy reduce-scatters gradient buckets (ZeRO-1/2/3) and all-gathers parameter buckets
(ZeRO-1/2 after the step, ZeRO-3 around each unit). gloo has no reduce-scatter of its own
(torch emulates it with an all-reduce and copies), so rayzero used an in-place all-reduce for
it; `Axis` now exchanges the chunks point to point on gloo. This times, on real gloo groups of
2 and 4 processes (one thread each, as a CPU rank runs), for buckets of 1, 4 and 16 MiB:

    reduce-scatter   torch's all_reduce (what rayzero did) / reduce_scatter_tensor (what
                     FSDP2 calls) / `Axis.start_reduce_scatter`
    all-gather       torch's all_gather_into_tensor / `Axis.start_all_gather`

Each is the median of 5 blocks of 20 calls, each block between barriers, the candidates
interleaved block by block so that the machine's drift falls on all alike. The ratio is
rayzero's time over the old way's (below 1: faster).

    python benchmarks/collectives.py [--worlds 2 4] [--mib 1 4 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayzero.sharding.comm import Axis, wait

BLOCKS, CALLS = 5, 20


def _time(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    for _ in range(CALLS):
        fn()
    dist.barrier()
    return (time.perf_counter() - t) / CALLS * 1e3


def _run(rank: int, world: int, mibs: list[int], port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    axis = Axis(dist.group.WORLD, world, rank)
    rows = {}
    for mib in mibs:
        n = mib * 2**20 // 4 // world * world
        full, c = torch.randn(n), n // world
        shard = full[rank * c:(rank + 1) * c].clone()
        candidates = {
            "all_reduce": lambda: dist.all_reduce(full),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(full[rank * c:(rank + 1) * c], full),
            "rayzero reduce-scatter": lambda: wait(axis.start_reduce_scatter(full)),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard),
            "rayzero all-gather": lambda: wait(axis.start_all_gather(full, shard)),
        }
        for fn in candidates.values():  # warm-up
            fn()
        times = {name: [] for name in candidates}
        for _ in range(BLOCKS):
            for name, fn in candidates.items():
                times[name].append(_time(fn))
        rows[mib] = {name: statistics.median(ts) for name, ts in times.items()}
    if rank == 0:
        out[world] = rows
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--mib", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    with mp.Manager() as manager:
        for world in args.worlds:
            out = manager.dict()
            mp.spawn(_run, args=(world, args.mib, free_port(), out), nprocs=world)
            results[world] = out[world]
    print(f"{'ranks':>5} {'MiB':>4} | reduce-scatter ms: all_reduce  rs_tensor  rayzero  ratio"
          f" | all-gather ms: torch  rayzero  ratio")
    for world, rows in results.items():
        for mib, r in rows.items():
            rs, ag = r["rayzero reduce-scatter"], r["rayzero all-gather"]
            print(f"{world:>5} {mib:>4} | {r['all_reduce']:>28.2f} {r['reduce_scatter_tensor']:>10.2f}"
                  f" {rs:>8.2f} {rs / r['all_reduce']:>6.2f}x | {r['all_gather_into_tensor']:>20.2f}"
                  f" {ag:>8.2f} {ag / r['all_gather_into_tensor']:>6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(w): {str(m): r for m, r in rows.items()} for w, rows in results.items()}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
