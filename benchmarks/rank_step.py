"""A rank's own step, without Ray: rayzero's `Rank.iteration` against plain DDP and FSDP2 in
plain processes, in alternating rounds, and, with `--before REF`, rayzero as the tree at git
revision REF had it, side by side with the working tree in the same rounds.

`step_time.py` measures the step as users run it, in Ray actors driven by a compiled graph;
its rounds are minutes apart, and a small point's peers move by several per cent between them.
Here the ranks are the actors' code without the actors (`Rank` set up, then iterations, as
tests/dist runs them), each run a fresh pair of processes (gloo, one torch thread each), the
runs of a round back to back, their order rotating from round to round: what a change to the
step itself is worth, measured against the same peers within a minute.

    python benchmarks/rank_step.py [--point 0.5M/mb1024/acc1] [--runs FSDP2 optim_grads_params]
                                   [--before REF] [--rounds 4] [--steps 30]

A point is `SIZE/mbTOKENS/accN` as in `step_time.py` (0.5M, 3M or 10M; 128, 1,024 or 4,096
tokens a micro-batch; N micro-batches a rank). A run is `DDP`, `FSDP2`, `alone` (plain torch,
nothing communicated: the compute floor) or a `sharding.strategy`; with `--before`, each
strategy runs again as `<strategy>@REF` from a `git worktree` of REF. Reported: each run's
median step (after 3 unmeasured) per round, and the median over rounds of its ratio to the
first run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
WORLD, WARMUP = 2, 3


def _overrides(point: str, data: str) -> list[str]:
    """`point`'s config keys as `step_time.py`'s grid has them."""
    from step_time import grid

    points = {p.name: p.overrides for p in grid(data, None)}
    if point not in points:
        raise SystemExit(f"--point {point}: not a point of the grid ({', '.join(points)})")
    return points[point]


def _rank(rank: int, run: str, tree: str | None, overrides: list[str], steps: int, data: str, port: int, out) -> None:
    if tree is not None:  # rayzero as another revision has it: its package ahead of the installed one
        sys.path.insert(0, tree)
    from rayzero.config import load_config

    torch.set_num_threads(1)
    strategy = run.split("@")[0]
    plain_run = strategy in ("DDP", "FSDP2", "alone")
    cfg = load_config(None, [*overrides, f"sharding.strategy={'no_shard' if plain_run else strategy}",
                             f"train.steps={steps + WARMUP}"])
    times = []
    if plain_run:
        import torch.distributed as dist

        import plain

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        trainer = plain.PlainTrainer(cfg, data, fsdp2=strategy == "FSDP2",
                                     wrap=plain.alone if strategy == "alone" else None)
        times = [trainer.step(k)[0] for k in range(steps + WARMUP)]
        trainer.close()
        dist.destroy_process_group()
    else:
        from rayzero.workers.rank import Rank

        r = Rank(cfg, rank, WORLD, data)
        r.setup("127.0.0.1", port)
        for k in range(steps + WARMUP):
            t0 = time.perf_counter()
            r.iteration({"step": k, "lr": 1e-3})
            times.append(time.perf_counter() - t0)
        r.close()
    if rank == 0:
        import rayzero

        out[run] = statistics.median(times[WARMUP:]) * 1e3
        out[run, "from"] = os.path.dirname(os.path.dirname(rayzero.__file__))


def worktree(ref: str, where: Path) -> str:
    """A checkout of `ref` (a `git worktree`, removed at the end): the directory its rayzero is in."""
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(where), ref], cwd=ROOT, check=True)
    return str(where)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", default="0.5M/mb1024/acc1")
    ap.add_argument("--runs", nargs="+", default=["FSDP2", "optim_grads_params"])
    ap.add_argument("--before", metavar="REF", help="also run each strategy from git revision REF")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    from rayzero.data.corpus import ensure_default_corpus
    from tests.conftest import free_port

    data = ensure_default_corpus("~/.cache/rayzero/datasets")
    overrides = _overrides(args.point, data)
    tmp = Path(tempfile.mkdtemp())
    trees: dict[str, str | None] = {r: None for r in args.runs}
    if args.before:
        old = worktree(args.before, tmp / "before")
        trees |= {f"{r}@{args.before}": old for r in args.runs if r not in ("DDP", "FSDP2", "alone")}
    runs = list(trees)
    print(f"{args.point}: {', '.join(runs)}; {args.rounds} rounds of {args.steps} steps, {WORLD} ranks, gloo\n")
    medians: dict[str, list[float]] = {r: [] for r in runs}
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            for rnd in range(args.rounds):
                for run in runs[rnd % len(runs):] + runs[: rnd % len(runs)]:
                    mp.spawn(_rank, args=(run, trees[run], overrides, args.steps, data, free_port(), out),
                             nprocs=WORLD)
                    medians[run].append(out[run])
                print(f"round {rnd + 1}: " + "  ".join(f"{r} {medians[r][-1]:.1f}" for r in runs) + " ms", flush=True)
            wheres = {r: out[r, "from"] for r in runs}
    finally:
        if args.before:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before")], cwd=ROOT, check=False)
    first = runs[0]
    print(f"\nmedian step (ms) per round, and the median over rounds of its ratio to {first}'s "
          "(rayzero imported from):")
    for r in runs:
        ratio = statistics.median(a / b for a, b in zip(medians[r], medians[first]))
        print(f"{r:<32} " + " ".join(f"{v:7.1f}" for v in medians[r]) + f"   ratio {ratio:.3f}   {wheres[r]}")


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    main()
