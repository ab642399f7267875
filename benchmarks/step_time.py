"""Step time and peak memory at 2 ranks over a grid of shapes: rayzero against what a user
would pick instead, side by side in one invocation.

The grid (gloo, one CPU and one torch thread per rank): three GPT sizes (`0.5M`: 2 layers of
width 128; `3M`: 4 of width 256; `10M`: the `small` preset, 10.8M), micro-batches of 128,
1,024 and 4,096 tokens (2 x 64, 8 x 128, 16 x 256), and gradient accumulation 1 and 4; and,
with `--llama`, an HF Llama of 9.7M parameters at 1,024 tokens. At each point, every run:

    DDP               plain torch: DDP over gloo, AdamW (what torchrun runs; `plain.py`)
    FSDP2             plain torch: `fully_shard` on each block and on the root
    Ray Train DDP     `TorchTrainer` with `prepare_model` (DDP), the same training step
    Ray Train FSDP2   `TorchTrainer` with `fully_shard` per block and root
    alone             plain torch, each rank training its own rows with nothing communicated
                      (`plain.alone`): the compute floor, what any strategy's step costs at
                      least with these kernels; a target below it is out of every strategy's reach
    rayzero <s>       every sharding.strategy, in Ray actors driven by one compiled graph
                      per iteration, as `rayzero train` drives them
    rayzero <s> looped  with `--looped`: the same actors, each rank running the point's
                      iterations itself, one after another (`Rank.iteration`), with no compiled
                      graph and no driver between them: what the graph's dispatch costs a step
                      (no target; the iterations' results are read at the end)

Plain torch and rayzero start fresh processes (actors) at each point, as a user's job does;
Ray Train's two trainers start once, before anything is measured, and take the points one by
one from a queue (a trainer takes ~15 s to start). All runs of a point execute back to back,
one at a time. Per point: the median step time after warmup (for rayzero, the ranks' pace: from
the end of one iteration to the end of the next on the slowest rank, as the plain runs time
their steps, not when the driver read the result), its ratio to DDP's and to FSDP2's, and each
rank's peak RSS during that point (VmHWM, reset when the point begins). For rayzero also the
time in each phase (the slowest rank). The whole grid runs in
rounds (default 2, the order of the runs rotating), and the figure reported for a point is
the median over rounds of each round's ratio.

Targets, at every point: rayzero no_shard and optim <= 1.03x DDP and below Ray Train DDP;
optim_grads <= 1.10x DDP; optim_grads_params <= 0.90x FSDP2 and below Ray Train FSDP2; peak
RSS per rank at most the corresponding peer's (DDP's; FSDP2's for optim_grads_params). A
summary line per strategy gives its worst and its median point.

With `--variant KEY=VALUE ...`, every rayzero run also runs a second time at each point with
those overrides (its name ends in `*`), side by side with the first in the same rounds: a change
of a setting or its default measured against the same DDP steps.

    python benchmarks/step_time.py [--rounds 2] [--points SUBSTR ...] [--runs NAME ...] [--llama]
                                   [--set KEY=VALUE ...] [--variant KEY=VALUE ...] [--looped] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402
import plain  # noqa: E402
from peers import PlainRun, RayTrainRun, peak_mib, reset_peak, trim  # noqa: E402

from rayzero.cluster.dispatch import CompiledDispatch  # noqa: E402
from rayzero.cluster.schedule import lr_at  # noqa: E402
from rayzero.cluster.worker_group import WorkerGroup  # noqa: E402
from rayzero.config import load_config  # noqa: E402
from rayzero.data.corpus import ensure_default_corpus  # noqa: E402
from rayzero.workers.actor import RankShim, rank_actor  # noqa: E402
from rayzero.workers.rank import Rank  # noqa: E402

WORLD = 2
SIZES = {"0.5M": ["model.n_layer=2", "model.n_embd=128", "model.n_head=4"],
         "3M": ["model.n_layer=4", "model.n_embd=256", "model.n_head=4"],
         "10M": ["model.preset=small"]}
PARAMS = {"0.5M": 0.45e6, "3M": 3.3e6, "10M": 10.8e6, "llama": 9.7e6}
MICRO = {128: (2, 64), 1024: (8, 128), 4096: (16, 256)}  # tokens: (sequences, seq_len)
TIMED_S, FLOPS = 3.0, 4e10
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
BASELINES = ("DDP", "FSDP2", "Ray Train DDP", "Ray Train FSDP2", "alone")
RUNS = BASELINES + tuple(f"rayzero {s}" for s in STRATEGIES)
TARGETS = {"no_shard": ("DDP", 1.03, "Ray Train DDP"), "optim": ("DDP", 1.03, "Ray Train DDP"),
           "optim_grads": ("DDP", 1.10, None), "optim_grads_params": ("FSDP2", 0.90, "Ray Train FSDP2")}


@dataclass
class Point:
    name: str
    overrides: list[str]
    params: float
    tokens: int  # per rank per step
    steps: int = 0
    warmup: int = 0

    def __post_init__(self):
        # About TIMED_S of timed steps per run (a step of a few ms is noise on its own), at
        # least 3 at the costly points; the estimate is 6 flops per parameter and token at
        # FLOPS per rank, plus a fixed cost per step.
        est = 6 * self.params * self.tokens / FLOPS + 0.01
        self.warmup = 2 if est < 2 else 1
        self.steps = self.warmup + min(max(math.ceil(TIMED_S / est), 2 if est > 5 else 3), 60)

    def config(self, *extra: str):
        return load_config(None, [*self.overrides, f"train.steps={self.steps}", *extra])


def grid(data_path: str, llama: str | None) -> list[Point]:
    points = []
    models = [(size, SIZES[size]) for size in SIZES] + ([("llama", ["model.kind=hf", f"model.path={llama}"])]
                                                        if llama else [])
    for size, model in models:
        for tokens, (mb, seq) in MICRO.items():
            for accum in (1, 4):
                if size == "llama" and (tokens != 1024):
                    continue
                points.append(Point(f"{size}/mb{tokens}/acc{accum}", [
                    *model, f"train.seq_len={seq}", f"train.micro_batch_size={mb}",
                    f"train.global_batch_size={mb * WORLD * accum}", f"cluster.num_workers={WORLD}",
                    "cluster.cpus_per_worker=1", "tracking.enabled=false", f"data.path={data_path}"],
                    PARAMS[size], tokens * accum))
    return sorted(points, key=lambda p: (p.params, p.tokens))


# -- rayzero -----------------------------------------------------------------------------

class BenchShim(RankShim):
    """A rank actor whose `Rank` (and process group) is built when the point begins."""

    def __init__(self, *_args):
        self.rank = None

    def reset(self, cfg, rank: int, world: int, data_path: str) -> None:
        self.release()
        self.rank = Rank(cfg, rank, world, data_path)
        reset_peak()

    def peak(self) -> tuple[float, float]:
        return peak_mib()

    def pid(self) -> int:
        return os.getpid()

    def loop(self, plans: list[dict]) -> list[dict]:
        """`--looped`: the point's iterations run by this rank itself, one after another in this
        process (`Rank.iteration`), with no compiled graph and no driver between them."""
        return [self.rank.iteration(plan) for plan in plans]

    def close(self) -> None:
        self.release()

    def release(self) -> None:
        """After a point: free the rank's state while the other runs take theirs."""
        if getattr(self.rank, "strategy", None) is not None:
            self.rank.close()
        self.rank = None
        trim()


class RayzeroRun:
    def __init__(self, strategy: str, data_path: str, extra: list[str], looped: bool = False):
        self.strategy, self.data_path, self.extra, self.looped = strategy, data_path, extra, looped
        self.group = WorkerGroup.create(rank_actor(BenchShim), WORLD, {"CPU": 1}, lambda rank: ())

    def ready(self) -> None:
        ray.get([a.peak.remote() for a in self.group.actors])

    def run(self, point: Point) -> dict:
        cfg = point.config(f"sharding.strategy={self.strategy}", *self.extra)
        actors = self.group.actors
        ray.get([a.reset.remote(cfg, r, WORLD, self.data_path) for r, a in enumerate(actors)])
        self.group.rendezvous()
        plan = lambda k: {"step": k, "lr": lr_at(k, cfg.train.steps, cfg.optim)}  # noqa: E731
        # A step's time is the ranks' pace, as the plain runs time theirs: from the end of one
        # iteration to the end of the next on the slowest rank (`done_at`, a wall clock on this
        # one machine), not when the driver got round to reading it.
        if self.looped:
            last = time.time()
            by_rank = ray.get([a.loop.remote([plan(k) for k in range(cfg.train.steps)]) for a in actors])
            steps = [list(results) for results in zip(*by_rank)]
        else:
            steps, last = self._dispatched(actors, cfg, plan)
        times, losses, phases = [], [], []
        for results in steps:
            end = max(r["done_at"] for r in results)
            times.append(end - last)
            last = end
            phases.append({p: max(r["phase_s"][p] for r in results) for p in results[0]["phase_s"]})
            losses.append(sum(r["loss_sum"] for r in results) / sum(r["tokens"] for r in results))
        peaks = ray.get([a.peak.remote() for a in actors])
        ray.get([a.release.remote() for a in actors])
        return {"step_s": times, "losses": losses, "peak_rss_mib": [p[0] for p in peaks],
                "growth_mib": [p[1] for p in peaks], "phase_s": phases}

    @staticmethod
    def _dispatched(actors: list, cfg, plan) -> tuple[list[list[dict]], float]:
        """The point's iterations through one compiled graph, as the Controller drives them (the
        next iteration queued before this one is read): each one's results, and when the first
        was submitted."""
        dispatch = CompiledDispatch(actors, cfg.grad_accum, timeout_s=3600)
        try:
            out = []
            pending, began = dispatch.submit(plan(0)), time.time()
            for k in range(cfg.train.steps):
                queued = dispatch.submit(plan(k + 1)) if k + 1 < cfg.train.steps else None
                out.append(dispatch.collect(pending))
                pending = queued
            return out, began
        finally:
            dispatch.close()

    def close(self) -> None:
        pids = ray.get([a.pid.remote() for a in self.group.actors])
        self.group.shutdown()
        wait_gone(pids)


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    """Until these processes have exited: a run's teardown is not measured with the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)


# -- the grid ------------------------------------------------------------------------------

@dataclass
class Cell:
    ratio_ddp: list[float] = field(default_factory=list)  # one per round
    ratio_fsdp2: list[float] = field(default_factory=list)
    median_ms: list[float] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    growth_mib: float = 0.0  # the peak over the RSS before the point: the run's own memory
    phase_ms: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


def median_after(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:] or values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--points", nargs="*", default=[], help="only the points whose name holds one of these")
    ap.add_argument("--runs", nargs="*", default=[], help="only these runs (names as in the table), and DDP/FSDP2")
    ap.add_argument("--llama", action="store_true", help="add an HF Llama point (9.7M parameters)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for the rayzero runs only, e.g. sharding.bucket_numel=262144")
    ap.add_argument("--variant", nargs="*", default=[], metavar="KEY=VALUE",
                    help="also run each rayzero run with these overrides (named with a trailing *)")
    ap.add_argument("--looped", action="store_true",
                    help="also run each rayzero run with its ranks looping their iterations, no compiled graph")
    args = ap.parse_args()
    data_path = ensure_default_corpus("~/.cache/rayzero/datasets")
    tmp = tempfile.TemporaryDirectory()
    llama = None
    if args.llama:
        from vs_torchrun import make_llama

        llama = make_llama(Path(tmp.name) / "llama")
    points = [p for p in grid(data_path, llama) if not args.points or any(s in p.name for s in args.points)]
    runs = [r for r in RUNS if not args.runs or r in ("DDP", "FSDP2") or r in args.runs]
    if args.variant:
        runs += [f"{r}*" for r in runs if r.startswith("rayzero ")]
    if args.looped:
        runs += [f"{r} looped" for r in runs if r.startswith("rayzero ") and not r.endswith("*")]
    print(f"{len(points)} points x {len(runs)} runs x {args.rounds} round(s), {WORLD} ranks, gloo"
          + (f"; * = with {' '.join(args.variant)}" if args.variant else "") + "\n")

    ray.init(num_cpus=2 * len(runs) + 2, logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    ray.cloudpickle.register_pickle_by_value(plain)
    ray.cloudpickle.register_pickle_by_value(peers)
    cells: dict[tuple[str, str], Cell] = {(p.name, r): Cell() for p in points for r in runs}
    workers = {}  # Ray Train's runs: one TorchTrainer each for the whole grid

    def start(r: str):
        """A run's processes, up and idle. Plain torch and rayzero start fresh at each point,
        as a user's job does, so that a point's peak RSS is its own and not what earlier,
        smaller points left in the process; Ray Train starts once (a trainer takes ~15 s)."""
        if r in ("DDP", "FSDP2", "alone"):
            w = PlainRun(WORLD, r == "FSDP2", data_path, wrap=plain.alone if r == "alone" else None)
        elif r.startswith("Ray Train"):
            w = RayTrainRun(WORLD, r.endswith("FSDP2"), data_path, str(Path(tmp.name) / "ray-train"))
        else:
            w = RayzeroRun(r.removeprefix("rayzero ").rstrip("*").removesuffix(" looped"), data_path,
                           [*args.set, *(args.variant if r.endswith("*") else [])], looped=r.endswith(" looped"))
        w.ready()
        return w

    done: list[Point] = []  # Ctrl-C reports the points measured so far
    failed: list[tuple[str, str]] = []  # (point, run) that raised
    try:
        for r in runs:
            if r.startswith("Ray Train"):
                workers[r] = start(r)  # up before anything is measured
        for rnd in range(args.rounds):
            for p in points:
                order = runs[rnd % len(runs):] + runs[: rnd % len(runs)]
                got = {}
                for r in order:
                    try:
                        w = workers.get(r) or start(r)
                        try:
                            got[r] = w.run(p)
                        finally:
                            if r not in workers:
                                w.close()
                    except Exception as e:  # the other runs and points go on; the report says so
                        print(f"round {rnd + 1} {p.name}: {r} failed: {str(e).strip().splitlines()[0][:300]}",
                              flush=True)
                        failed.append((p.name, r))
                        if r in ("DDP", "FSDP2"):
                            raise
                ms = {r: median_after(v["step_s"], p.warmup) * 1e3 for r, v in got.items()}
                line = []
                for r, v in got.items():
                    c = cells[(p.name, r)]
                    c.median_ms.append(ms[r])
                    c.ratio_ddp.append(ms[r] / ms["DDP"])
                    c.ratio_fsdp2.append(ms[r] / ms["FSDP2"])
                    c.peak_rss_mib = max(c.peak_rss_mib, max(v["peak_rss_mib"]))
                    c.growth_mib = max(c.growth_mib, max(v["growth_mib"]))
                    c.losses = v["losses"][:3]
                    for name, _ in (v.get("phase_s") or [{}])[0].items():
                        c.phase_ms.setdefault(name, []).append(
                            median_after([s[name] for s in v["phase_s"]], p.warmup) * 1e3)
                    line.append(f"{r} {ms[r]:.0f}")
                print(f"round {rnd + 1} {p.name:<18} " + "  ".join(line) + " ms", flush=True)
                if p not in done:
                    done.append(p)
    except KeyboardInterrupt:
        print(f"\ninterrupted: reporting the {len(done)} point(s) measured")
    except Exception as e:
        print(f"\nstopped by {type(e).__name__}: {e}\nreporting the {len(done)} point(s) measured")
    finally:
        for w in workers.values():
            try:
                w.close()
            except Exception as e:
                print(f"closing: {e}")
        ray.shutdown()
    report(done, runs, cells, args)


def report(points, runs, cells, args) -> None:
    print("\nper point: median over rounds of the step-time ratio to DDP (to FSDP2, in brackets), and the max "
          "over ranks and rounds of the peak RSS per rank / of its growth during the point, in MiB")
    print(f"{'point':<18} " + " ".join(f"{r:>24}" for r in runs))
    for p in points:
        row = []
        for r in runs:
            c = cells[(p.name, r)]
            if not c.ratio_ddp:
                row.append("failed")
                continue
            ratio = statistics.median(c.ratio_ddp)
            extra = f"[{statistics.median(c.ratio_fsdp2):.2f}]" if r.rstrip("*").removesuffix(" looped").endswith(
                ("FSDP2", "optim_grads_params", "alone")) else ""
            row.append(f"{ratio:6.3f}{extra:>7} {c.peak_rss_mib:4.0f}/{c.growth_mib:<4.0f}")
        print(f"{p.name:<18} " + " ".join(f"{x:>24}" for x in row))
    print("\nrayzero per-phase times (ms, median over rounds, slowest rank):")
    for p in points:
        for r in runs:
            c = cells[(p.name, r)]
            if c.phase_ms:
                print(f"  {p.name:<18} {r:<28} " + "  ".join(
                    f"{k} {statistics.median(v):.1f}" for k, v in c.phase_ms.items()))
    checks = []
    for (s, (peer, target, ray_peer)), star in [(t, star) for t in TARGETS.items() for star in ("", "*")]:
        r, s = f"rayzero {s}{star}", f"{s}{star}"
        if r not in runs:
            continue
        key = "ratio_fsdp2" if peer == "FSDP2" else "ratio_ddp"
        per_point = []
        for p in points:
            c = cells[(p.name, r)]
            if not getattr(c, key):
                per_point.append((math.inf, p.name, False, None, math.inf, None))
                continue
            ray_cell = cells.get((p.name, ray_peer))
            ray_ratio = (statistics.median(getattr(ray_cell, key)) if ray_peer in runs and getattr(ray_cell, key)
                         else None)
            ratio = statistics.median(getattr(c, key))
            # Memory: the peak RSS per rank, the process's runtime (Ray's in an actor) included.
            rss = c.peak_rss_mib / max(cells[(p.name, peer)].peak_rss_mib, 1.0)
            ok = ratio <= target and (ray_ratio is None or ratio < ray_ratio) and rss <= 1.0
            floor = cells.get((p.name, "alone"))
            floor = statistics.median(getattr(floor, key)) if floor is not None and getattr(floor, key) else None
            per_point.append((ratio, p.name, ok, ray_ratio, rss, floor))
        worst = max(per_point)
        med = sorted(per_point)[len(per_point) // 2]
        fails = [x for x in per_point if not x[2]]
        checks.append({"strategy": s, "peer": peer, "target": target, "worst": worst[:2], "median": med[:2],
                       "failing_points": [{"point": x[1], "ratio": x[0], "ray_train": x[3], "rss_ratio": x[4],
                                           "floor": x[5]} for x in fails]})
        print(f"{'PASS' if not fails else 'FAIL'}  {s} / {peer}: worst {worst[0]:.3f} at {worst[1]}, median "
              f"{med[0]:.3f} at {med[1]} (target <= {target}" + (f", below {ray_peer}" if ray_peer else "")
              + f", peak RSS <= {peer}'s); {len(fails)} point(s) miss")
        for x in fails:
            print(f"        {x[1]}: {x[0]:.3f}" + (f", {ray_peer} {x[3]:.3f}" if x[3] is not None else "")
                  + f", RSS {x[4]:.2f}x" + (f", compute floor {x[5]:.3f}" if x[5] is not None else "")
                  + (" (the target is below the floor: out of reach)" if x[5] is not None and x[5] > target else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "step_time", "world_size": WORLD, "rounds": args.rounds, "torch": torch.__version__,
            "ray": ray.__version__, "points": [p.__dict__ for p in points],
            "cells": {f"{k[0]}|{k[1]}": c.__dict__ for k, c in cells.items()}, "checks": checks}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
