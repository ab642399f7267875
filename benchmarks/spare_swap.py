"""A warm spare takes a killed rank's place, on a local Ray: the mechanics and their cost.

At world 2 (the small GPT of the failure tests, a commit every 4 steps), rank 1's process is
SIGKILLed while an iteration runs. The survivor is not restarted: the compiled graph is torn
down, rank 0 leaves its broken process group, a warm spare is assigned rank 1, both set up at a
new rendezvous and load the last commit, a new graph is compiled on the same survivor actor and
the spare, and training runs on to the end. The final weights must equal an unbroken run's
bitwise. Also: spares asked beyond the free CPUs give one warning, and a spare replenished into
the lost rank's vacant bundle comes up warm.

Prints each stage's seconds (and writes them with `--json`):
    flock /tmp/rayzero-ray.lock python benchmarks/spare_swap.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rayzero.checkpoint.manifest import open_checkpoint  # noqa: E402
from rayzero.cluster.checkpoints import Checkpoints  # noqa: E402
from rayzero.cluster.dispatch import CompiledDispatch  # noqa: E402
from rayzero.cluster.schedule import lr_at  # noqa: E402
from rayzero.cluster.worker_group import Spares, WorkerGroup  # noqa: E402
from rayzero.config import load_config  # noqa: E402
from rayzero.data.tokens import prepare  # noqa: E402
from rayzero.workers.actor import RankActor  # noqa: E402

STEPS, EVERY, KILL_AT = 16, 4, 10  # commits after steps 3, 7; rank 1 dies in step 10: resume at 8
BUNDLE = {"CPU": 1.0}


def dataset(root: Path) -> str:
    """The stdlib's `json` and `email` sources, as a prepared dataset (as the tests make one)."""
    src, texts = Path(json.__file__).parent.parent, root / "texts"
    texts.mkdir()
    for pkg in ("json", "email"):
        for f in sorted((src / pkg).glob("*.py")):
            (texts / f"{pkg}_{f.name}").write_text(f.read_text())
    prepare(texts, str(root / "data"), pattern="*.py", row_group_tokens=1 << 14)
    return str(root / "data")


def config(ckpt: str):
    return load_config(None, [
        "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64", "train.global_batch_size=8",
        "train.micro_batch_size=2", "optim.warmup_steps=2", "cluster.num_workers=2", f"train.steps={STEPS}",
        f"checkpoint.dir={ckpt}", f"checkpoint.every_steps={EVERY}", "failure.spares=1"])


class Run:
    """The controller's part, cut to what this needs: plans, commits, the newest commit."""

    def __init__(self, cfg, group: WorkerGroup):
        self.cfg, self.group, self.ckpt = cfg, group, Checkpoints(cfg)
        self.infos = group.rendezvous()
        self.ckpt.configure(self.infos, None)
        self.dispatch = CompiledDispatch(group.actors, cfg.grad_accum_for(cfg.mesh(2)), timeout_s=60)

    def plan(self, k: int) -> dict:
        return {"step": k, "lr": lr_at(k, STEPS, self.cfg.optim), "checkpoint": self.ckpt.plan(k),
                "evaluate": False}

    def steps(self, first: int, last: int) -> None:
        for k in range(first, last):
            self.ckpt.collect(k, self.dispatch.run(self.plan(k)))

    def finish(self) -> dict:
        self.dispatch.close()
        reports = ray.get([a.finish_checkpoints.remote() for a in self.group.actors])
        self.ckpt.add_uploads([u for r in reports for u in r])
        return ray.get([a.full_state_dict.remote() for a in self.group.actors])[0]


def group_of(cfg, data: str) -> WorkerGroup:
    group = WorkerGroup.create(RankActor, 2, BUNDLE, lambda rank: (cfg, rank, 2, data, None))
    group.wait_started()
    return group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the stage timings here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    tmp = Path(tempfile.mkdtemp(prefix="spare-swap-"))
    data = dataset(tmp)
    # 2 ranks and 1 spare of 1 CPU: the second spare asked for below has no room.
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR")
    try:
        t0 = time.perf_counter()
        reference = unbroken(config(str(tmp / "ref")), data)
        print(f"unbroken run: {time.perf_counter() - t0:.1f} s", flush=True)
        timings, state = swapped(config(str(tmp / "ckpt")), data)
    finally:
        ray.shutdown()
    print(f"whole script: {time.perf_counter() - t0:.1f} s", flush=True)
    same = reference.keys() == state.keys() and all(torch.equal(reference[k], state[k]) for k in reference)
    timings["bitwise_equal"] = same
    for k, v in timings.items():
        print(f"{k:>22}: {v:.3f}" if isinstance(v, float) else f"{k:>22}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(timings, indent=2))
    if not same:
        sys.exit("the resumed run's weights differ from the unbroken run's")


def unbroken(cfg, data: str) -> dict:
    group = group_of(cfg, data)
    try:
        run = Run(cfg, group)
        run.steps(0, STEPS)
        return run.finish()
    finally:
        group.shutdown()


def swapped(cfg, data: str) -> tuple[dict, dict]:
    group = group_of(cfg, data)
    spares = Spares.start(RankActor, 2, BUNDLE, lambda: (cfg, None, 2, data, None))  # 1 fits: a warning
    t: dict = {"spares_placed": len(spares)}
    try:
        run = Run(cfg, group)
        run.steps(0, KILL_AT)
        committed = run.ckpt.last_committed
        pid, survivor_pid = run.infos[1]["pid"], run.infos[0]["pid"]
        # SIGKILL rank 1 as soon as the iteration is submitted; an iteration that finishes
        # first (one takes some 50 ms) is kept, and the next one meets the dead rank.
        pending = run.dispatch.submit(run.plan(KILL_AT))
        os.kill(pid, signal.SIGKILL)
        struck = time.perf_counter()
        for k in range(KILL_AT, KILL_AT + 2):
            try:
                run.ckpt.collect(k, run.dispatch.collect(pending, queued=False))
            except (ray.exceptions.RayError, ray.exceptions.RayChannelError) as e:
                t["detection_s"] = time.perf_counter() - struck
                t["error"] = type(e).__name__
                break
            pending = run.dispatch.submit(run.plan(k + 1))
        else:
            raise AssertionError("two iterations finished with a rank killed")
        assert run.ckpt.last_committed == committed
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            t[f"{name}_s"] = now - mark
            mark = now

        run.dispatch.close()  # every actor loop stopped, the dead one's aside
        lap("teardown")
        survivor = group.actors[0]
        left = ray.get(survivor.leave.remote(5.0), timeout=30)
        t["uploads_left"] = len(left["uploads"])
        lap("leave")
        spare = spares.take(timeout_s=10)
        assert spare is not None, "no warm spare"
        group.replace(1, spare.actor, spare.pg, spare.bundle_index)
        ray.get(spare.actor.assign.remote(1, 2), timeout=30)
        lap("assign")
        run.infos = group.rendezvous()
        run.ckpt.configure(run.infos, None)
        lap("rendezvous")
        t["survivor_kept_its_process"] = run.infos[0]["pid"] == survivor_pid
        c = open_checkpoint(committed)
        ray.get([a.load_checkpoint.remote(c.uri, c.manifest) for a in group.actors], timeout=60)
        ray.get([a.apply_checkpoint.remote() for a in group.actors], timeout=60)
        lap("load")
        run.dispatch = CompiledDispatch(group.actors, cfg.grad_accum_for(cfg.mesh(2)), timeout_s=60)
        lap("compile")
        run.steps(c.step, c.step + 1)
        lap("first_step")
        t["resumed_at"] = c.step
        t["total_s"] = sum(v for k, v in t.items() if k.endswith("_s"))
        t["total_but_load_s"] = t["total_s"] - t["load_s"]
        spares.replenish(group.vacant_bundle())  # into the lost rank's bundle, still reserved
        run.steps(c.step + 1, STEPS)
        state = run.finish()
        replenished = spares.take(timeout_s=60)
        t["replenished_warm"] = replenished is not None
        if replenished is not None:
            ray.kill(replenished.actor, no_restart=True)
        return t, state
    finally:
        spares.kill()
        group.shutdown()


if __name__ == "__main__":
    main()
