"""Controller overhead per iteration: the three dispatchers driving no-op phases.

Every rank is a `NoopRank` actor whose phases (gather, forward, backward, reduce_scatter,
step: one micro-batch) return a small dict at once, so an iteration's wall time on the
driver is the dispatch cost alone. For each world size the same actors are driven by
`PerPhaseDispatch` (one `ray.get` per phase), `PipelinedDispatch` (every phase submitted at
once, one `ray.get`) and `CompiledDispatch` (one Ray Compiled Graph execution), back to back
in this process; after warmup iterations each reports the median and p90 milliseconds per
iteration.

Targets at 4 ranks (informational; the exit code is 0 either way):
  - compiled: median at most 1 ms per iteration;
  - per_phase / compiled: at least 10x.

    python benchmarks/dispatch.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import ray

from rayzero.cluster.dispatch import CompiledDispatch, PerPhaseDispatch, PipelinedDispatch
from rayzero.workers.phases import iteration
from rayzero.cluster.worker_group import WorkerGroup

WORLD_SIZES = (2, 4, 8)
NUM_MICROBATCHES = 1
DISPATCHERS = {"per_phase": PerPhaseDispatch, "pipelined": PipelinedDispatch, "compiled": CompiledDispatch}
TARGET_WORLD = 4
TARGET_COMPILED_MS = 1.0
TARGET_SPEEDUP = 10.0


@ray.remote
class NoopRank:
    def gather(self, plan: dict) -> dict:
        return {"phase": "gather"}

    def forward(self, prev: dict) -> dict:
        return {"phase": "forward"}

    def backward(self, prev: dict) -> dict:
        return {"phase": "backward"}

    def reduce_scatter(self, prev: dict) -> dict:
        return {"phase": "reduce_scatter"}

    def step(self, prev: dict) -> dict:
        return {"phase": "step"}

    def evaluate(self, prev: dict) -> dict:  # a step without evaluation passes the step's result on
        return prev


def time_dispatch(dispatch, warmup: int, iters: int, world: int) -> list[float]:
    """Milliseconds per iteration, `iters` of them after `warmup` untimed ones."""
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        out = dispatch.run({"step": i, "lr": 0.0})
        dt = time.perf_counter() - t0
        if len(out) != world or any(o != {"phase": "step"} for o in out):
            raise RuntimeError(f"{type(dispatch).__name__} returned {out!r}")
        if i >= warmup:
            times.append(dt * 1e3)
    return times


def measure_world(world: int, warmup: int, iters: int, cpus: float, placement_timeout_s: float) -> list[dict]:
    group = WorkerGroup.create(NoopRank, world, {"CPU": cpus}, lambda r: (), placement_timeout_s=placement_timeout_s)
    rows = []
    try:
        for name, cls in DISPATCHERS.items():
            dispatch = cls(group.actors, NUM_MICROBATCHES)
            try:
                times = time_dispatch(dispatch, warmup, iters, world)
            finally:
                dispatch.close()  # an actor holds one compiled graph at a time
            rows.append({
                "world_size": world,
                "dispatcher": name,
                "iters": iters,
                "median_ms": statistics.median(times),
                "p90_ms": statistics.quantiles(times, n=10)[-1],
                "min_ms": min(times),
            })
    finally:
        group.shutdown()
    per_phase = rows[0]["median_ms"]
    for row in rows:
        row["per_phase_over_this"] = per_phase / row["median_ms"]
    return rows


def check_targets(rows: list[dict]) -> list[dict]:
    at = {r["dispatcher"]: r for r in rows if r["world_size"] == TARGET_WORLD}
    compiled_ms = at["compiled"]["median_ms"]
    speedup = at["compiled"]["per_phase_over_this"]
    return [
        {"name": f"compiled median at {TARGET_WORLD} ranks (ms)", "value": compiled_ms,
         "target": f"<= {TARGET_COMPILED_MS:g}", "pass": compiled_ms <= TARGET_COMPILED_MS},
        {"name": f"per_phase / compiled at {TARGET_WORLD} ranks", "value": speedup,
         "target": f">= {TARGET_SPEEDUP:g}", "pass": speedup >= TARGET_SPEEDUP},
    ]


def print_table(rows: list[dict]) -> None:
    header = f"{'ranks':>5}  {'dispatcher':<10}  {'median ms':>9}  {'p90 ms':>8}  {'min ms':>8}  {'per_phase/x':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['world_size']:>5}  {r['dispatcher']:<10}  {r['median_ms']:>9.3f}  {r['p90_ms']:>8.3f}  "
              f"{r['min_ms']:>8.3f}  {r['per_phase_over_this']:>10.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    ap.add_argument("--cpus-per-actor", type=float, default=0.1, help="CPUs reserved per no-op actor")
    ap.add_argument("--placement-timeout-s", type=float, default=60.0, help="give up placing a group after this")
    args = ap.parse_args()
    warmup, iters = (10, 100) if args.quick else (50, 1000)

    if not ray.is_initialized():
        # Logical CPUs: no-op actors may share a core, so never fewer than the largest group needs.
        num_cpus = max(os.cpu_count() or 1, math.ceil(max(WORLD_SIZES) * args.cpus_per_actor))
        ray.init(num_cpus=num_cpus, logging_level="WARNING")
    phases = iteration(NUM_MICROBATCHES)
    print(f"no-op phases per rank per iteration: {len(phases)} ({', '.join(phases)}); "
          f"{warmup} warmup + {iters} timed iterations per dispatcher\n")
    rows = []
    for world in WORLD_SIZES:
        rows += measure_world(world, warmup, iters, args.cpus_per_actor, args.placement_timeout_s)
    print_table(rows)
    targets = check_targets(rows)
    print()
    for t in targets:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {t['value']:.3f} (target {t['target']})")

    if args.json:
        result = {
            "benchmark": "dispatch",
            "num_microbatches": NUM_MICROBATCHES,
            "phases": phases,
            "warmup": warmup,
            "iters": iters,
            "cpus_per_actor": args.cpus_per_actor,
            "ray_version": ray.__version__,
            "results": rows,
            "targets": targets,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
