"""Recovery time with and without a warm spare: from a killed rank to the next completed step.

Two training runs of the `small` model (10.8M parameters) at 4 ranks (`--ranks`) on a local Ray, side by
side in this process, with a checkpoint every 10 steps: one with `failure.spares=0` (a lost
rank restarts the whole group: every actor killed, a new placement group, new processes that
import torch again), one with `failure.spares=1` (a warm standby actor takes the lost rank's
place; the other ranks keep their processes and rejoin). In each, this script SIGKILLs one
rank's process several times, each after a new commit, and reads the controller's record of
each recovery, split into:

  - detection: the kill to the controller knowing who failed and how;
  - replacement: the failed group torn down, and a group of the same world ready to load
    (the restart: backoff, placement, new processes, rendezvous, build; the spare: the
    survivors leaving their process group, the spare put in, rendezvous, build);
  - load: every rank reading the last commit;
  - first_step: the first iteration after it (the graph compiled again, one step), beside
    the median of the steps before the kill (the steady step) and each phase's time.

Target: detection + replacement <= 3 s with one spare. With --hang, the 0-spare run also
freezes a rank once (SIGSTOP, `failure.phase_timeout_s=5`) and reports its detection.

With `--before REF`, the same runs again right after from git revision REF (a worktree), and
each stage's median of the two side by side, as a ratio.

    python benchmarks/recovery.py [--kills 3] [--hang] [--ranks 4] [--set KEY=VALUE ...] [--only 0|1]
                                  [--before REF] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rayzero.cluster.checkpoints import Checkpoints  # noqa: E402
from rayzero.cluster.controller import Controller  # noqa: E402
from rayzero.jobs.tracking import NullTracker  # noqa: E402
from rayzero.config import load_config  # noqa: E402
from rayzero.jobs.train import resolve_data  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("detection", "replacement", "load", "first_step")
# the controller's timings (failure.timings) that make up each stage after detection
PARTS = {"replacement": ("teardown", "leave", "backoff", "placement", "replacement", "rendezvous"),
         "load": ("load",), "first_step": ("graph", "first_step")}
HANG_TIMEOUT_S = 5.0
TARGET_S = 3.0


def wait_for(predicate, timeout_s: float = 600.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError("the run did not get there")


def stages(failure, struck_at: float, timeout_s: float = 0.0) -> dict:
    t = failure.timings
    row = {"detection": failure.detected_at - struck_at + t["diagnose_s"] - timeout_s}
    for stage, parts in PARTS.items():
        row[stage] = sum(t.get(f"{p}_s", 0.0) for p in parts)
    row["total"] = sum(row[s] for s in STAGES)
    row["detection+replacement"] = row["detection"] + row["replacement"]
    return row


def strike(controller, errors: list, how: str, i: int, rng: random.Random) -> dict | None:
    """Wait for a new commit while training, then kill (or freeze) one rank; the recovery's row."""
    commits = controller.checkpoints.commits
    wait_for(lambda: controller.checkpoints.commits > commits and controller.state == "TRAIN" or errors)
    if errors:
        return None
    time.sleep(rng.uniform(0.0, 1.0))
    h = controller.history
    steady = statistics.median(h.step_s[-5:])
    steady_phase = {k: statistics.median(v[-5:]) for k, v in h.phase_s.items()}
    pid = rng.choice(sorted(controller.pids))
    struck = time.time()
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    wait_for(lambda: len(controller.failures) > i and "total_s" in controller.failures[i].timings or errors)
    if errors:
        return None
    f = controller.failures[i]
    wait_for(lambda: len(h.step_s) > 1 and h.steps[-1] > controller.record.start_step or errors)
    if errors:
        return None
    at = h.steps.index(controller.record.start_step)  # the first step after the recovery
    first_phase = {k: v[at] for k, v in h.phase_s.items()}
    print("  phases, first step after / steady: " + ", ".join(
        f"{k} {first_phase[k]:.2f}/{steady_phase[k]:.2f}" for k in first_phase), flush=True)
    return {"how": how, "rank": f.rank, "kind": f.kind, "at_step": f.step, "decision": f.decision,
            "steady_step": steady, "timings": dict(f.timings),
            **stages(f, struck, HANG_TIMEOUT_S if how == "hang" else 0.0)}


def measure(spares: int, kills: int, hang: bool, root: Path, ranks: int = 4, extra: tuple = ()) -> list[dict]:
    cfg = load_config(None, [
        "model.preset=small", f"cluster.num_workers={ranks}", "cluster.cpus_per_worker=1", "train.steps=100000",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=128",
        f"checkpoint.dir={root / 'ckpt'}", "checkpoint.every_steps=10", "checkpoint.keep_last=2",
        "failure.max_restarts=-1", f"failure.phase_timeout_s={HANG_TIMEOUT_S}", f"failure.spares={spares}",
        f"train.output_dir={root}", *extra,
    ])
    data = resolve_data(cfg)
    ray.init(num_cpus=ranks + 1, logging_level="ERROR", include_dashboard=False)  # room for one spare
    controller = Controller(cfg, data, str(root), NullTracker(), progress=False, checkpoints=Checkpoints(cfg))
    errors: list = []

    def fit():
        try:
            controller.fit()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    rng = random.Random(spares)
    rows = []
    for i, how in enumerate(["kill"] * kills + (["hang"] if hang else [])):
        row = strike(controller, errors, how, i, rng)
        if row is None:
            break
        row["spares"] = spares
        rows.append(row)
        print(f"spares={spares} {how:5s} rank {row['rank']} at step {row['at_step']} -> {row['decision']}: "
              + "  ".join(f"{k} {row[k]:.2f}" for k in (*STAGES, "total")) + f" s; steady step {row['steady_step']:.2f} s ("
              + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in row["timings"].items()) + ")", flush=True)
    controller.stop()  # ends the run after the iteration in flight (its actors and spares go with it)
    thread.join(timeout=120)
    ray.shutdown()
    if errors and not rows:
        raise SystemExit(f"the run with failure.spares={spares} failed: {errors[0]!r}")
    return rows


def before(ref: str, args) -> list[dict]:
    """The rows of `measure` as it is at git revision `ref`, for the same arguments, run in a
    process of its own from a worktree of `ref` (its own rayzero first on the path: the
    driver's and the ranks')."""
    from rank_step import worktree  # (its checkout, as zero3_gathers.py takes it)

    where = Path(worktree(ref, Path(tempfile.mkdtemp(prefix="rayzero-recovery-before-")) / "tree"))
    call = ("import json, sys, tempfile; from pathlib import Path; sys.path.insert(0, 'benchmarks'); "
            "import recovery; a = json.loads(sys.argv[1]); rows = []\n"
            "for s in a['spares']:\n"
            "    rows += recovery.measure(s, a['kills'], a['hang'] and s == 0, "
            "Path(tempfile.mkdtemp(prefix='rayzero-recovery-')), a['ranks'], tuple(a['set']))\n"
            "Path(a['out']).write_text(json.dumps(rows))")
    out = where / "rows.json"
    given = {"spares": (0, 1) if args.only is None else (args.only,), "kills": args.kills, "hang": args.hang,
             "ranks": args.ranks, "set": args.set, "out": str(out)}
    try:
        subprocess.run([sys.executable, "-c", call, json.dumps(given)], cwd=where,
                       env={**os.environ, "PYTHONPATH": str(where)}, check=True)
        return json.loads(out.read_text())
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)


def compare(rows: list[dict], old: list[dict], ref: str) -> None:
    """Each stage's median (kills only), this tree against `ref`'s, per number of spares."""
    keys = ("steady_step", "graph", *STAGES, "total")
    for spares in sorted({r["spares"] for r in rows}):
        mine = [r for r in rows if r["spares"] == spares and r["how"] == "kill"]
        theirs = [r for r in old if r["spares"] == spares and r["how"] == "kill"]
        if not mine or not theirs:
            continue
        print(f"\n{spares} spare{'s' if spares != 1 else ''}, medians of {len(mine)} / {len(theirs)} kills (seconds):")
        print(f"| stage | {ref} | this tree | ratio |\n|---|---|---|---|")
        for k in keys:
            a, b = (statistics.median(_value(r, k) for r in rs) for rs in (theirs, mine))
            print(f"| {k} | {a:.2f} | {b:.2f} | {b / a if a else float('nan'):.2f} |")


def _value(row: dict, key: str) -> float:
    return row["timings"].get("graph_s", 0.0) if key == "graph" else row[key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--hang", action="store_true", help="also freeze a rank once in the 0-spare run")
    ap.add_argument("--only", type=int, choices=(0, 1), help="one run only, with this many spares")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides, e.g. parallel.tp=2")
    ap.add_argument("--before", metavar="REF", help="the same runs again from git revision REF, compared")
    args = ap.parse_args()

    rows = []
    for spares in (0, 1) if args.only is None else (args.only,):
        root = Path(tempfile.mkdtemp(prefix=f"rayzero-recovery-{spares}-"))
        rows += measure(spares, args.kills, args.hang and spares == 0, root, args.ranks, tuple(args.set))
    old = before(args.before, args) if args.before else None

    keys = (*STAGES, "total", "detection+replacement")
    med = {s: {k: statistics.median(r[k] for r in rows if r["spares"] == s and r["how"] == "kill") for k in keys}
           for s in {r["spares"] for r in rows}}
    if len(med) < 2:
        print(json.dumps(med, indent=2))
    else:
        print(f"\nmedian of {args.kills} kills each, small model, {args.ranks} ranks {' '.join(args.set)} (seconds):")
        print("| stage | 0 spares | 1 spare | 1 spare / 0 spares |\n|---|---|---|---|")
        for k in keys:
            print(f"| {k} | {med[0][k]:.2f} | {med[1][k]:.2f} | {med[1][k] / med[0][k]:.2f} |")
        got = med[1]["detection+replacement"]
        print(f"\ndetection + replacement with 1 spare <= {TARGET_S:g} s: {'PASS' if got <= TARGET_S else 'FAIL'} "
              f"({got:.2f} s; {med[0]['detection+replacement']:.2f} s without)")
    hang = [r for r in rows if r["how"] == "hang"]
    if hang:
        print(f"hang: caught {hang[0]['detection']:.2f} s after failure.phase_timeout_s={HANG_TIMEOUT_S:g}; "
              f"back training {hang[0]['total'] + HANG_TIMEOUT_S:.1f} s after the rank froze")
    if old is not None:
        compare(rows, old, args.before)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "median_kill": med,
                                               **({"before": {"ref": args.before, "rows": old}} if old else {})}, indent=2))

if __name__ == "__main__":
    main()
