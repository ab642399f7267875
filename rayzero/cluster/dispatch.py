"""How the controller runs one iteration's phases on every rank.

Each dispatcher has `submit(plan) -> Pending` and `collect(pending) -> [dict per rank]`, so the
controller can keep the next iteration queued while it reads this one's results (a rank that
finishes early then starts the next iteration instead of idling), and `run(plan)` for both
at once. All three give the same result; they differ in what one iteration costs the driver:
- `CompiledDispatch`: one Ray Compiled Graph, built once, executed once per iteration;
- `PipelinedDispatch`: every phase submitted at once with `.remote()`, each fed the previous
  phase's ref, then one `ray.get` (the fallback where compiled graphs are unavailable);
- `PerPhaseDispatch`: one `ray.get` per phase (the baseline the benchmark compares against).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode

from rayzero.workers.phases import iteration

# Waiting on a compiled graph's output spins a core in the driver (measured: ~100% of one
# core for the whole iteration), and on a machine with few cores that core is taken from the
# ranks. So the driver first sleeps until the iteration should be done: it began when the
# iteration before it ended (each rank reports when it finished, `done_at`, on its clock) or
# when it was submitted, whichever is later, and lasts about as long as recent ones (the
# median of what the slowest rank reports of its phases, `phase_s`). Waking late costs the
# ranks nothing: the controller keeps the next iteration queued, so they work on it while the
# driver sleeps; waking early spins for the rest. With nothing queued behind it (the run's last
# iteration, or one whose evaluation may end the run) a late wake would only hold up what comes
# next, so that one is read as soon as it is done. The driver's own clock cannot anchor it: a
# result that was ready when the driver woke may have been ready for a while, and a guess
# made from that drifts later each iteration until the ranks run out of queued work.
NAP_MIN_S = 0.005
RECENT = 3
PARTS = ("data",)  # times a rank reports that are part of a phase's (gather's), not after it


class Nap:
    """When the driver should start reading an iteration's results, from the iterations
    before it (pure bookkeeping: no Ray, no sleeping)."""

    def __init__(self):
        self.recent: deque[float] = deque(maxlen=RECENT)  # how long recent iterations' work took
        self.last_end: float | None = None  # when the last one collected ended (wall clock)

    def wake_at(self, submitted: float, now: float) -> float | None:
        """The wall-clock time to sleep until before reading the iteration submitted at
        `submitted`, or None to read at once. Never more than one iteration from `now`: a
        rank whose clock runs ahead of the driver's cannot make it oversleep by more."""
        if not self.recent or self.last_end is None:
            return None
        expected = statistics.median(self.recent)
        if expected <= NAP_MIN_S:
            return None
        return min(max(submitted, self.last_end) + expected, now + expected)

    def observe(self, results: list, submitted: float, woke: float, done: float) -> None:
        """An iteration's results, read at `done` after sleeping until `woke` (wall clock)."""
        start = max(submitted, self.last_end) if self.last_end is not None else submitted
        ends = [r.get("done_at") for r in results if isinstance(r, dict)]
        end = max(ends) if ends and len(ends) == len(results) and None not in ends else None
        work = _work_s(results)
        if work is None:  # ranks that report no phase times: the driver's clock
            # Waiting at all means the work took until `done`. No wait means it finished
            # during the nap, some unknown time earlier: assume well earlier, to adapt fast.
            work = done - start if done - woke > 1e-3 else 0.8 * (woke - start)
        self.recent.append(work)
        self.last_end = end if end is not None else min(done, start + work)


class _DeadActorCancel(logging.Filter):
    """Ray's compiled graph logs a traceback for every dead actor it cannot cancel a task on
    while it tears down; after a failure those actors are dead on purpose (the controller
    kills the whole group), and the failure is reported once, by the controller."""

    def filter(self, record: logging.LogRecord) -> bool:
        dead = record.exc_info and isinstance(record.exc_info[1], ray.exceptions.RayActorError)
        return not (dead and record.getMessage().startswith("Error cancelling worker task"))


logging.getLogger("ray.dag.compiled_dag_node").addFilter(_DeadActorCancel())


@dataclass
class Pending:
    """An iteration submitted to the ranks and not yet collected."""

    handle: Any  # the dispatcher's own: refs, or the plan itself
    submitted_at: float  # wall clock (time.time()), comparable with the ranks' `done_at`


class _Dispatch:
    timeout_s: float
    preparing: str | None = None  # what building it does, for the start-up's lines (None: nothing to say)

    def run(self, plan: dict) -> list[dict]:
        return self.collect(self.submit(plan))

    def submit(self, plan: dict) -> Pending:
        return Pending(self._submit(plan), time.time())

    def collect(self, pending: Pending, queued: bool = True) -> list[dict]:
        """The ranks' results of `pending`; `queued`: whether another iteration is queued behind it."""
        return ray.get(pending.handle, timeout=self.timeout_s)

    def _submit(self, plan: dict):
        raise NotImplementedError

    def close(self) -> None:
        pass


class CompiledDispatch(_Dispatch):
    preparing = "compiling the iteration (Ray Compiled Graph)"

    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        names = iteration(num_microbatches)
        with InputNode() as plan:
            outputs = []
            for actor in actors:
                node = plan
                for name in names:
                    node = getattr(actor, name).bind(node)
                outputs.append(node)
        self.graph = MultiOutputNode(outputs).experimental_compile()
        self.nap = Nap()

    def _submit(self, plan: dict):
        return self.graph.execute(plan)

    def collect(self, pending: Pending, queued: bool = True) -> list[dict]:
        wake = self.nap.wake_at(pending.submitted_at, time.time()) if queued else None
        if wake is not None:
            time.sleep(max(0.0, wake - time.time()))
        woke = time.time()
        out = ray.get(pending.handle, timeout=self.timeout_s)
        self.nap.observe(out, pending.submitted_at, woke, time.time())
        return out

    def close(self) -> None:
        if self.graph is not None:
            self.graph.teardown()
            self.graph = None


def _work_s(results: list) -> float | None:
    """How long the slowest rank worked on this iteration, from the phase times it reports."""
    times = [sum(v for k, v in r["phase_s"].items() if k not in PARTS)
             for r in results if isinstance(r, dict) and "phase_s" in r]
    return max(times) if times and len(times) == len(results) else None


class PipelinedDispatch(_Dispatch):
    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0):
        self.actors, self.names, self.timeout_s = actors, iteration(num_microbatches), timeout_s

    def _submit(self, plan: dict):
        refs = []
        for actor in self.actors:
            ref = plan
            for name in self.names:
                ref = getattr(actor, name).remote(ref)
            refs.append(ref)
        return refs


class PerPhaseDispatch(_Dispatch):
    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0):
        self.actors, self.names, self.timeout_s = actors, iteration(num_microbatches), timeout_s

    def _submit(self, plan: dict):
        return plan  # nothing runs until collect: one phase at a time

    def collect(self, pending: Pending, queued: bool = True) -> list[dict]:
        outs = [pending.handle] * len(self.actors)
        for name in self.names:
            outs = ray.get(
                [getattr(a, name).remote(o) for a, o in zip(self.actors, outs)], timeout=self.timeout_s
            )
        return outs


DISPATCHERS = {"compiled": CompiledDispatch, "pipelined": PipelinedDispatch, "per_phase": PerPhaseDispatch}
