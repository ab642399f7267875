"""The driver's cost per iteration of the compiled dispatch, flat (the driver reads every
rank's result) against merged per node (the driver reads one result per node), as the world grows.

Every rank is a `NoopRank` actor: its phases (gather, forward, backward, reduce_grads, step,
evaluate: one micro-batch) do no work but time themselves and return what a real rank returns
(loss and token sums, phase times, the memory ledger, uploads, `done_at`), so the driver and
the node merges handle results of the real size and shape. The dispatch is the real one:
`CompiledDispatch` over these ranks, each with its own task chain and output channel, with the
ranks grouped into 1, 2 or 4 simulated nodes (all on this machine; each node's `NodeMerger` is
a real actor). A simulated node's ranks share one process (`NoopHost`): a compiled graph's
reader spins a core while it waits, and 32 spinning processes on 2 cores would measure the
contention rather than the dispatch.

Driver cost of one iteration = submit to last reply, less the slowest rank's own reported work
(`work_s`); the first iterations (the compile's first execution, the processes' warm-up) are
left out. From the merged measurements it fits cost = a + b * nodes + c * ranks_per_node
(least squares; a: the fixed cost of an execution, b: the driver's read of one more node's
result, c: one more rank merged on its node) and models 1,024 ranks on 128 nodes.

Targets (the exit code is 0 either way):
  - merged, modelled at 1,024 ranks on 128 nodes: at most 10 ms per iteration (1 % of a 1 s step);
  - merged, measured at 8 ranks on one node: median at most 1 ms per iteration.

    python benchmarks/dispatch.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time

import ray

from rayzero.cluster.dispatch import FAN_IN, CompiledDispatch
from rayzero.workers.phases import iteration
from rayzero.step_report import merge

WORLD_SIZES = (2, 4, 8, 16, 32)
NODES = (1, 2, 4)
NUM_MICROBATCHES = 1
MODEL_RANKS, MODEL_NODES = 1024, 128
TARGET_MODEL_MS = 10.0
TARGET_WORLD, TARGET_NODES, TARGET_MS = 8, 1, 1.0
MEMORY_KEYS = ("compute_params", "main_params", "optimizer", "grads", "frozen_params", "total",
               "transient_peak", "activations_peak")


class NoopRank:
    """A rank that does nothing, timed and reported as `Rank` reports it."""

    def __init__(self, rank: int):
        self.rank = rank
        self.plan: dict = {}
        self.times: dict[str, float] = {}
        self.finished: int | None = None

    def progress(self) -> dict:
        return {"rank": self.rank, "step": self.plan.get("step"), "phase": None, "elapsed_s": 0.0,
                "finished": self.finished}

    def gather(self, plan: dict) -> dict:
        t0 = time.perf_counter()
        self.plan = plan
        self.times = {"data": 0.0, "forward": 0.0, "backward": 0.0}
        self.times["gather"] = time.perf_counter() - t0
        return {}

    def forward(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        self.times["forward"] += time.perf_counter() - t0
        return {}

    def backward(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        self.times["backward"] += time.perf_counter() - t0
        return {}

    def reduce_grads(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        self.times["reduce_grads"] = time.perf_counter() - t0
        return {}

    def step(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        self.times["step"] = time.perf_counter() - t0
        self.times["checkpoint"] = 0.0
        return {"rank": self.rank, "step": self.plan["step"], "lr": self.plan["lr"],
                "loss_sum": 1234.5 + self.rank, "tokens": 4096, "aux_loss_sum": None,
                "grad_norm": 1.0, "skipped": False, "loss_scale": None,
                "memory": {k: 1_000_000 + i for i, k in enumerate(MEMORY_KEYS)},
                "phase_s": dict(self.times), "uploads": [], "checkpointed": False}

    def evaluate(self, result: dict) -> dict:
        t0 = time.perf_counter()
        self.finished = self.plan["step"]
        return {**result, "phase_s": {**result["phase_s"], "evaluate": time.perf_counter() - t0},
                "done_at": time.time()}


class NoopHost:
    """The no-op ranks of one simulated node in one process: each rank keeps its own tasks and
    its own output channel in the graph (what the driver and the node's merger read is as with
    one process per rank), but a compiled graph's reader spins a core while it waits, and on
    a small machine one spinning process per rank would measure the contention, not the
    dispatch. Its ranks run one after another: `busy` keeps, per step, the time they spent
    from reading the plan to handing on their result, which on a cluster runs in parallel on
    their own cores and so is the ranks' own time, not the dispatch's."""

    def __init__(self):
        self.ranks: dict[int, NoopRank] = {}
        self.busy: dict[int, float] = {}
        self.began = 0.0

    def reset(self) -> None:
        self.ranks, self.busy = {}, {}

    def progress(self, r: int | None = None) -> dict:
        """The host's ranks; with `r`, that rank's progress, as the driver asks a rank through the first
        iterations of a graph."""
        if r is None:
            return {"ranks": sorted(self.ranks)}
        return self.ranks.get(r, NoopRank(r)).progress()

    def spans(self) -> dict[int, float]:
        return self.busy

    def gather(self, plan: dict, r: int) -> dict:
        self.began = time.perf_counter()
        return self.ranks.setdefault(r, NoopRank(r)).gather(plan)

    def forward(self, prev: dict, r: int) -> dict:
        return self.ranks[r].forward(prev)

    def backward(self, prev: dict, r: int) -> dict:
        return self.ranks[r].backward(prev)

    def reduce_grads(self, prev: dict, r: int) -> dict:
        return self.ranks[r].reduce_grads(prev)

    def step(self, prev: dict, r: int) -> dict:
        return self.ranks[r].step(prev)

    def evaluate(self, result: dict, r: int) -> dict:
        out = self.ranks[r].evaluate(result)
        step = out["step"]
        self.busy[step] = self.busy.get(step, 0.0) + time.perf_counter() - self.began
        return out


class HostedRank:
    """One rank of a `NoopHost`, as the dispatch sees an actor: `rank.gather.bind(x)` binds the
    host's `gather(x, rank)`, so the graph holds this rank's own task chain."""

    def __init__(self, host, rank: int):
        self.host, self.rank = host, rank

    def __getattr__(self, name: str):
        return _ForRank(getattr(self.host, name), self.rank)


class _ForRank:
    def __init__(self, method, rank: int):
        self.method, self.rank = method, rank

    def bind(self, *args):
        return self.method.bind(*args, self.rank)

    def remote(self, *args):
        return self.method.remote(*args, self.rank)


def time_dispatch(dispatch: CompiledDispatch, world: int, warmup: int, iters: int, settle_s: float | None = None
                  ) -> tuple[list[float], list[float]]:
    """Per iteration, `iters` of them after `warmup` untimed ones, in milliseconds: submit to
    last reply, and the slowest rank's reported work. With `settle_s`, the driver sleeps that
    long between submitting and reading, so every result is ready when it reads: the first
    list is then the driver's own work (the submit, then reading and unpickling each output)."""
    totals, works = [], []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        pending = dispatch.submit({"step": i, "lr": 1e-3, "ledgers": False})
        t1 = time.perf_counter()
        if settle_s is not None:
            time.sleep(settle_s)
        t2 = time.perf_counter()
        out = dispatch.collect(pending, queued=False)
        dt = (t1 - t0) + time.perf_counter() - t2 if settle_s is not None else time.perf_counter() - t0
        merged = merge(out, ledgers=False)  # what the controller reads; checked, not timed
        if merged["ranks"] != world or merged["tokens"] != 4096 * world or merged["step"] != i:
            raise RuntimeError(f"wrong results: {merged!r}")
        if i >= warmup:
            totals.append(dt * 1e3)
            works.append(merged["work_s"] * 1e3)
    return totals, works


def merge_cost_ms(n: int = 2000) -> float:
    """Milliseconds a node's merger spends per rank beyond reading its channel: unpickling a
    rank's result and merging it (measured here, in-process)."""
    results = [_sample(r) for r in range(8)]
    blobs = [pickle.dumps(r) for r in results]
    t0 = time.perf_counter()
    for _ in range(n // 8):
        merge([pickle.loads(b) for b in blobs], ledgers=False)
    return (time.perf_counter() - t0) * 1e3 / (n // 8 * 8)


def _sample(rank: int) -> dict:
    r = NoopRank(rank)
    r.gather({"step": 0, "lr": 1e-3})
    return r.evaluate(r.step(r.reduce_grads(r.backward(r.forward({})))))


def measure(hosts: list, world: int, nodes: int, per_node: bool, warmup: int, iters: int, ready_iters: int,
            fan_in: int = FAN_IN) -> dict:
    node_of = [r * nodes // world for r in range(world)]  # consecutive ranks per node, as PACK places them
    ray.get([h.reset.remote() for h in hosts])
    ranks = [HostedRank(hosts[n], r) for r, n in enumerate(node_of)]
    dispatch = CompiledDispatch(ranks, NUM_MICROBATCHES, timeout_s=120.0, nodes=[f"node{n}" for n in node_of],
                                per_node=per_node, fan_in=fan_in)
    try:
        totals, works = time_dispatch(dispatch, world, warmup, iters)
        settle = max(0.002, 2 * statistics.median(totals) / 1e3)
        driver, _ = time_dispatch(dispatch, world, warmup // 2, ready_iters, settle_s=settle)
    finally:
        dispatch.close()  # an actor belongs to one compiled graph at a time
    busy = ray.get([h.spans.remote() for h in hosts[:nodes]])
    # the ranks' own time: the busiest host's, where its ranks ran one after another
    own = [max(b.get(i, 0.0) for b in busy) * 1e3 for i in range(warmup, warmup + iters)]
    costs = [max(0.0, t - o) for t, o in zip(totals, own)]
    return {"ranks": world, "nodes": nodes, "dispatch": "merged" if per_node else "flat", "iters": iters,
            "median_ms": statistics.median(costs), "p90_ms": statistics.quantiles(costs, n=10)[-1],
            "min_ms": min(costs), "total_median_ms": statistics.median(totals),
            "ranks_own_median_ms": statistics.median(own), "work_median_ms": statistics.median(works),
            "outputs": dispatch.outputs, "driver_median_ms": statistics.median(driver),
            "driver_p90_ms": statistics.quantiles(driver, n=10)[-1]}


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares y = a + b * x: (a, b, the largest residual)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / (sum((x - mx) ** 2 for x, _ in points) or 1.0)
    a = my - b * mx
    return a, b, max(abs(a + b * x - y) for x, y in points)


def model(rows: list[dict], merge_ms: float) -> dict:
    """The driver's cost at `MODEL_RANKS` on `MODEL_NODES`, from measured inputs:
    a + b * outputs, the driver's own work (the submit, then a read and an unpickle per output
    it reads: one per rank flat), fitted over every row's ready reads; merged, the driver
    reads at most FAN_IN outputs, and the merges on the way add (b + m) per result each merger
    reads, level by level (a merger reads a channel as the driver does, b, and merges, m,
    measured in-process): its node's ranks, then up to FAN_IN results a level."""
    a, b, residual = line_fit([(r["outputs"], r["driver_median_ms"]) for r in rows])
    outputs, levels = MODEL_NODES, (b + merge_ms) * (MODEL_RANKS // MODEL_NODES)
    while outputs > FAN_IN:
        outputs, levels = -(-outputs // FAN_IN), levels + (b + merge_ms) * FAN_IN
    return {"a_ms": a, "b_ms_per_output": b, "m_ms_per_merged_result": merge_ms, "max_residual_ms": residual,
            "fan_in": FAN_IN, "driver_outputs": outputs, "merged_ms": a + b * outputs + levels,
            "flat_ms": a + b * MODEL_RANKS, "model_ranks": MODEL_RANKS, "model_nodes": MODEL_NODES}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def print_table(rows: list[dict]) -> None:
    by = {(r["ranks"], r["nodes"], r["dispatch"]): r for r in rows}
    worlds = sorted({r["ranks"] for r in rows})
    header = (f"{'ranks':>5} {'nodes':>5}  {'flat med':>8} {'flat p90':>8}  {'merged med':>10} {'merged p90':>10}"
              f"  {'flat/merged':>11}  {'driver flat':>11} {'driver merged':>13}")
    print(header)
    print("-" * len(header))
    for world in worlds:
        for nodes in NODES:
            f, m = by.get((world, nodes, "flat")), by.get((world, nodes, "merged"))
            if f is None or m is None:
                continue
            print(f"{world:>5} {nodes:>5}  {f['median_ms']:>8.3f} {f['p90_ms']:>8.3f}  {m['median_ms']:>10.3f} "
                  f"{m['p90_ms']:>10.3f}  {_ratio(f['median_ms'], m['median_ms']):>10.2f}x  {f['driver_median_ms']:>11.3f} "
                  f"{m['driver_median_ms']:>13.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLD_SIZES), help="rank counts to measure")
    ap.add_argument("--cpus-per-actor", type=float, default=0.05, help="CPUs reserved per no-op rank")
    args = ap.parse_args()
    warmup, iters, ready_iters = (10, 200, 60) if args.quick else (20, 300, 100)

    if not ray.is_initialized():
        ray.init(num_cpus=max(os.cpu_count() or 1, 2), logging_level="WARNING")
    phases = iteration(NUM_MICROBATCHES)
    print(f"no-op phases per rank per iteration: {len(phases)} ({', '.join(phases)}); {warmup} warm-up + "
          f"{iters} timed iterations per row; ms = submit to last reply less the slowest rank's work\n")
    hosts = [ray.remote(NoopHost).options(num_cpus=args.cpus_per_actor).remote() for _ in range(max(NODES))]
    ray.get([h.progress.remote() for h in hosts])
    rows = []
    try:
        for world in args.worlds:
            for nodes in NODES:
                if nodes > world:
                    continue
                for per_node in (False, True):
                    rows.append(measure(hosts, world, nodes, per_node, warmup, iters, ready_iters))
        if max(args.worlds) >= 8:  # the tree above the nodes, as 128 nodes would have it: fan-in 2 over 4 nodes
            rows.append({**measure(hosts, max(args.worlds), 4, True, warmup, iters, ready_iters, fan_in=2),
                         "dispatch": "tree"})
    finally:
        for h in hosts:
            ray.kill(h)
    print_table(rows)
    for r in rows:
        if r["dispatch"] == "tree":
            print(f"tree (fan-in 2 above {r['nodes']} nodes, {r['ranks']} ranks): median {r['median_ms']:.3f} ms, "
                  f"p90 {r['p90_ms']:.3f}, driver {r['driver_median_ms']:.3f} ms reading {r['outputs']} outputs")
    fitted = model(rows, merge_cost_ms())
    e2e = {d: line_fit([(r["ranks"], r["median_ms"]) for r in rows if r["dispatch"] == d]) for d in ("flat", "merged")}
    print("\nend to end, by ranks (this machine's cores shared by every process: contention, not only dispatch):"
          + "".join(f"\n  {d:<6} ms = {v[0]:.3f} + {v[1]:.4f} * ranks (largest residual {v[2]:.3f})" for d, v in e2e.items()))
    print(f"driver's own work (results ready when read), every row: ms = {fitted['a_ms']:.4f} + "
          f"{fitted['b_ms_per_output']:.4f} * outputs (largest residual {fitted['max_residual_ms']:.3f}); "
          f"merge per rank on its node {fitted['m_ms_per_merged_result']:.4f} ms")
    print(f"modelled at {MODEL_RANKS} ranks on {MODEL_NODES} nodes: merged {fitted['merged_ms']:.2f} ms "
          f"(driver reads {fitted['driver_outputs']}; merges of {MODEL_RANKS // MODEL_NODES} ranks a node, then "
          f"{FAN_IN} results a level), flat {fitted['flat_ms']:.2f} ms "
          f"(a + b*{MODEL_RANKS}): flat/merged {_ratio(fitted['flat_ms'], fitted['merged_ms']):.1f}x\n")
    # one node: the dispatch merges nothing (see CompiledDispatch), so the flat row is what runs
    at = next(r for r in rows if (r["ranks"], r["nodes"], r["dispatch"]) == (TARGET_WORLD, TARGET_NODES, "flat"))
    targets = [
        {"name": f"merged, modelled at {MODEL_RANKS} ranks on {MODEL_NODES} nodes (ms)", "value": fitted["merged_ms"],
         "target": f"<= {TARGET_MODEL_MS:g}", "pass": fitted["merged_ms"] <= TARGET_MODEL_MS},
        {"name": f"median at {TARGET_WORLD} ranks on {TARGET_NODES} node, end to end (ms)", "value": at["median_ms"],
         "target": f"<= {TARGET_MS:g}", "pass": at["median_ms"] <= TARGET_MS},
    ]
    for t in targets:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {t['value']:.3f} (target {t['target']})")
    if args.json:
        result = {"benchmark": "dispatch", "num_microbatches": NUM_MICROBATCHES, "phases": phases,
                  "warmup": warmup, "iters": iters, "cpus_per_actor": args.cpus_per_actor,
                  "cpus": os.cpu_count(), "ray_version": ray.__version__, "results": rows,
                  "model": fitted, "end_to_end_fit": {d: dict(zip(("a_ms", "ms_per_rank", "max_residual_ms"), v))
                                                      for d, v in e2e.items()}, "targets": targets}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
