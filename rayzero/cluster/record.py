"""What a run did, filled in by the controller's states as they go; the summary is made from it.

Kept apart from the states so that nothing passes between them through the controller: each
state reads what it needs from the run record and adds what it learned.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rayzero.cluster.failure import Failure

log = logging.getLogger(__name__)


@dataclass
class RunRecord:
    world: int  # the world size now (elastic: may shrink, then grow back)
    states: list[str] = field(default_factory=list)  # each state entered, by code, in order
    build: dict | None = None  # rank 0's answer to setup (model, params, flops, device), latest group
    pids: dict[int, int] = field(default_factory=dict)  # pid -> rank, of the live group
    step: int | None = None  # the iteration under way, or the last one done
    start_step: int = 0  # where the live group began training
    resumed_from: str | None = None  # the commit the live group resumed from
    first_start: tuple[int, str | None] | None = None  # (step, checkpoint) the run began at
    schedule_steps: int = 0  # the learning-rate schedule's length (see schedule.schedule_length)
    failures: list[Failure] = field(default_factory=list)
    resizes: list[dict] = field(default_factory=list)  # {"step", "from", "to"}: planned regrouping
    replacements: list[dict] = field(default_factory=list)  # a spare took a lost rank's place
    streak: int = 0  # failures since the last commit (the backoff grows with it)
    commits_then: int = 0  # commits counted at the last failure

    def failed(self, commits: int) -> int:
        """A failure happened with `commits` commits made so far: the failures in a row since
        the last commit, this one included."""
        self.streak = 1 if commits > self.commits_then else self.streak + 1
        self.commits_then = commits
        return self.streak


class RecoveryClock:
    """Times the stages of the recovery under way (detection, teardown, backoff, placement,
    rendezvous, load, first step) into its failure's `timings`; a no-op without one."""

    def __init__(self):
        self.failure: Failure | None = None
        self.t = 0.0

    def start(self, failure: Failure, at: float) -> None:
        self.failure, self.t = failure, at

    def mark(self, name: str) -> None:
        if self.failure is None:
            return
        now = time.time()
        timings = self.failure.timings
        timings[f"{name}_s"] = timings.get(f"{name}_s", 0.0) + now - self.t
        self.t = now

    def done(self) -> float | None:
        """The first step after the failure is done: its recovery's total seconds (None: no
        recovery under way)."""
        if self.failure is None:
            return None
        self.mark("first_step")
        f, self.failure = self.failure, None
        f.timings["total_s"] = time.time() - f.detected_at
        log.info("recovered from %s in %.1fs", f.kind, f.timings["total_s"])
        return f.timings["total_s"]
