"""The controller's watchdog: a thread that asks every rank what it is doing, once a second.

Each rank answers `progress()` from a separate thread of its actor (its own concurrency
group), so it answers while a phase runs. A rank that has spent longer than
`failure.phase_timeout_s` in one phase, or that stops answering for that long, counts as hung:
the watchdog records which rank, phase and step, and kills the group. The controller, blocked
on the iteration's result, then gets an error at once instead of waiting for torch's own
collective timeout, and asks the watchdog what happened.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

from rayzero.cluster.failure import HANG, Failure
from rayzero.workers.phases import CALLS

log = logging.getLogger(__name__)

# A rank still starting, one that has never answered (its actor's constructor imports torch,
# transformers and the model code) or is in `setup` (joining the group, building the model,
# reading its weights), counts as hung only after at least this long: with several ranks per
# core, or a large model, starting takes longer than a `phase_timeout_s` sized for a step.
STARTUP_GRACE_S = 60.0
STARTING = ("setup",)
# An iteration that compiles (`train.compile`: the first after setup, the first evaluation;
# `Rank.progress`'s `compiling`) counts as hung only after at least this long: a cold compile
# of a large model's blocks takes minutes, and a rank torn down in it compiles again.
COMPILE_GRACE_S = 300.0


class Watchdog:
    def __init__(self, actors: list, timeout_s: float, on_fire: Callable[[], None], interval_s: float = 1.0):
        self.actors = actors
        self.timeout_s = timeout_s
        self.interval_s = min(interval_s, timeout_s / 2)
        self.on_fire = on_fire  # tears the group down
        self.last: dict[int, dict] = {}  # rank -> its latest answer: step, phase, elapsed_s
        self.fired: Failure | None = None
        self._silent_since: dict[int, float] = {}  # rank -> when it last answered, while it does not
        self._answered: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayzero-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self._check():
                    return
            except Exception as e:  # the watchdog must never take the run down by itself
                log.debug("watchdog poll failed: %s", e)

    def _check(self) -> bool:
        refs = {r: a.progress.remote() for r, a in enumerate(self.actors)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.interval_s)
        now = time.monotonic()
        for r, ref in refs.items():
            if ref in ready:
                try:
                    self.last[r] = ray.get(ref)
                    self._silent_since.pop(r, None)
                    self._answered[r] = now
                except ray.exceptions.RayError:
                    pass  # a dead rank: the controller's own wait reports it
            else:
                self._silent_since.setdefault(r, self._answered.get(r, now))
        culprit = self._culprit(now)
        if culprit is None or self._stop.is_set():
            return False
        self.fired = culprit
        log.warning("watchdog: %s; tearing the group down", culprit.message)
        self.on_fire()
        return True

    def _culprit(self, now: float) -> Failure | None:
        """If any rank is past the timeout: the one furthest behind in the run's order (step,
        then phase) is the cause; the others are waiting for it inside a collective. Ranks are
        only loosely in step, so the cause need not be the one stuck longest."""
        silent = [(now - t, r) for r, t in self._silent_since.items() if now - t > self._limit(r not in self.last)]
        if silent:
            secs, r = max(silent)
            p = self.last.get(r, {})
            return Failure(HANG, f"rank {r} has not answered for {secs:.0f}s (failure.phase_timeout_s="
                                 f"{self.timeout_s:g}), last seen in phase {p.get('phase')} of step {p.get('step')}",
                           rank=r, phase=p.get("phase"), step=p.get("step"))
        busy = {r: p for r, p in self.last.items() if p.get("phase") and r not in self._silent_since}
        if not any(p["elapsed_s"] > self._limit(p["phase"] in STARTING, p.get("compiling")) for p in busy.values()):
            return None
        r = min(busy, key=lambda r: (_position(busy[r]), -busy[r]["elapsed_s"]))
        p = busy[r]
        grace = f"; compiling: at least {COMPILE_GRACE_S:g} s" if p.get("compiling") else ""
        return Failure(HANG, f"rank {r} spent {p['elapsed_s']:.0f}s in phase {p['phase']} of step {p['step']}"
                             f" (failure.phase_timeout_s={self.timeout_s:g}{grace})",
                       rank=r, phase=p["phase"], step=p["step"])

    def _limit(self, starting: bool, compiling: bool = False) -> float:
        if compiling:
            return max(self.timeout_s, COMPILE_GRACE_S)
        return max(self.timeout_s, STARTUP_GRACE_S) if starting else self.timeout_s


ORDER = CALLS  # the order a rank goes through its calls, to tell who is behind


def _position(progress: dict) -> tuple[int, int]:
    step = progress.get("step")
    return (-1 if step is None else step, ORDER.index(progress["phase"]) if progress["phase"] in ORDER else len(ORDER))
