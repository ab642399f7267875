"""How the controller runs one iteration's phases on every rank.

Each dispatcher has `submit(plan) -> Pending` and `collect(pending) -> [dict per rank]`, so the
controller can keep the next iteration queued while it reads this one's results (a rank that
finishes early then starts the next iteration instead of idling), and `run(plan)` for both
at once. All three give the same result; they differ in what one iteration costs the driver:
- `CompiledDispatch`: one Ray Compiled Graph, built once, executed once per iteration;
- `ChainedDispatch`: every phase submitted at once with `.remote()`, each fed the previous
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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayzero.workers.phases import iteration
from rayzero.step_report import merge, work_s

# Waiting on a compiled graph's output spins a core in the driver (measured: ~100% of one
# core for the whole iteration), and on a machine with few cores that core is taken from the
# ranks. So the driver first sleeps until the iteration should be done: it began when the
# iteration before it ended (each rank reports when it finished, `done_at`, on its clock) or
# when it was submitted, whichever is later, and lasts about as long as recent ones (the
# median of what the slowest rank reports of its phases, `phase_s`). Waking late costs the
# ranks nothing: the controller keeps the next iteration queued, so they work on it while the
# driver sleeps; waking early spins for the rest. With nothing queued behind it (the run's last
# iteration, or one whose evaluation may end the run) a late wake would hold up what comes
# next, so the driver wakes at LAST_SHARE of the expected time and spins for the rest. The
# driver's own clock cannot anchor it: a result that was ready when the driver woke may have
# been ready for a while, and a guess made from that drifts later each iteration until the
# ranks run out of queued work. The first two iterations, which nothing guesses, are waited
# for by asking the ranks how far they are (`CompiledDispatch._until_finished`).
NAP_MIN_S = 0.005
RECENT = 3
LAST_SHARE = 0.9
POLL_MIN_S, POLL_MAX_S = 0.01, 0.1  # how often an unguessed iteration's progress is asked (doubling)
# The most results one reader (a node's merger, or the driver) reads per iteration: past this
# many nodes the node results are merged again, this many at a time, on the first one's node
# (a tree, as Monarch gathers from thousands of actors). Measured (benchmarks/dispatch.py):
# each read costs a reader ~0.08 ms, so 128 nodes read by the driver would cost ~10 ms alone.
FAN_IN = 16


class Nap:
    """When the driver should start reading an iteration's results, from the iterations
    before it (pure bookkeeping: no Ray, no sleeping).

    The first iteration sets only where the next one begins, never how long they last: it
    runs the compiled graph's first execution and faults in the ranks' memory, often many
    times a step, and a median of the few recent iterations would keep it for two more."""

    def __init__(self):
        self.recent: deque[float] = deque(maxlen=RECENT)  # how long recent iterations' work took
        self.last_end: float | None = None  # when the last one collected ended (wall clock)

    def wake_at(self, submitted: float, now: float, queued: bool = True) -> float | None:
        """The wall-clock time to sleep until before reading the iteration submitted at
        `submitted`, or None to read at once; `queued`: whether another iteration is queued
        behind it (if not, the nap ends at LAST_SHARE of the expected time). Never more than one
        iteration from `now`: a rank whose clock runs ahead of the driver's cannot make it
        oversleep by more."""
        if not self.recent or self.last_end is None:
            return None
        expected = statistics.median(self.recent)
        if expected <= NAP_MIN_S:
            return None
        if not queued:
            expected *= LAST_SHARE
        return min(max(submitted, self.last_end) + expected, now + expected)

    def observe(self, results: list, submitted: float, woke: float, done: float) -> None:
        """An iteration's results, read at `done` after sleeping until `woke` (wall clock)."""
        first = self.last_end is None
        start = submitted if first else max(submitted, self.last_end)
        ends = [r.get("done_at") for r in results if isinstance(r, dict)]
        end = max(ends) if ends and len(ends) == len(results) and None not in ends else None
        work = _work_s(results)
        if work is None:  # ranks that report no phase times: the driver's clock
            if done - woke > 1e-3:  # it waited: the work took until `done`
                work = done - start
            else:  # it ended during the nap, some unknown time before `woke`: every guess kept
                # was too long, so start again from half the nap (halving, not a slow decay,
                # finds a short iteration in a few steps; one that waits then measures it)
                self.recent.clear()
                work = 0.5 * (woke - start)
        if not first:
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
    step: int | None = None  # the plan's


class _Dispatch:
    timeout_s: float
    preparing: str | None = None  # what building it does, for the start-up's lines (None: nothing to say)

    def run(self, plan: dict) -> list[dict]:
        return self.collect(self.submit(plan))

    def submit(self, plan: dict) -> Pending:
        return Pending(self._submit(plan), time.time(), plan.get("step"))

    def collect(self, pending: Pending, queued: bool = True) -> list[dict]:
        """The ranks' results of `pending`; `queued`: whether another iteration is queued behind it."""
        return ray.get(pending.handle, timeout=self.timeout_s)

    def _submit(self, plan: dict):
        raise NotImplementedError

    def close(self) -> None:
        pass


@ray.remote(num_cpus=0)
class NodeMerger:
    """Merges one node's ranks' results on that node (`results.merge`), so the driver reads
    one result per node. An actor of its own rather than one of the ranks: a rank that raises
    leaves the others waiting for it in a collective, and a merge queued behind one of those
    would hold the error back until the collective timed out; this one is free to pass it on
    at once (a compiled graph forwards an upstream exception without running the task)."""

    def merge(self, plan: dict, *results: dict) -> dict:
        return merge(list(results), ledgers=bool(plan.get("ledgers", True)))


def _node_id(_actor, *_args) -> str:
    return ray.get_runtime_context().get_node_id()


def node_ids(actors: list) -> list[str]:
    """The node each actor runs on (any actor class: asked through `__ray_call__`)."""
    return ray.get([a.__ray_call__.remote(_node_id) for a in actors])


def node_groups(nodes: list) -> list[list[int]]:
    """The ranks of each node, nodes in the order of their first rank."""
    groups: dict = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


class CompiledDispatch(_Dispatch):
    """One Ray Compiled Graph: the plan goes in once (Ray's shared-memory channel writes it
    once per node, for every reader there), each rank runs the iteration's phases, and on a
    cluster of several nodes each node's results are merged on that node, so the driver reads
    one result per node.

    Chosen by `benchmarks/dispatch.py`: reading every rank's result costs the driver a channel
    read and an unpickle per rank, which grows with the world; merged per node it grows with
    the nodes, and each node's merge runs beside the others'. On one node the merge is left
    out: the driver's reads of a node's few ranks cost about what the merge's extra hop does,
    and a merger waiting on a compiled-graph channel spins a core (as the driver would without
    its nap), which a small machine's ranks feel. `per_node` forces either way."""

    preparing = "compiling the iteration (Ray Compiled Graph)"

    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0,
                 nodes: list | None = None, per_node: bool | None = None, fan_in: int = FAN_IN,
                 staged: bool = False):
        """`nodes`: each rank's node, to group the ranks by (None: where Ray placed each actor;
        the benchmark passes simulated nodes); `per_node`: merge each node's results there
        (None: when the ranks are on more than one node); `fan_in`: see FAN_IN."""
        self.timeout_s = timeout_s
        self.actors = actors
        self.graph = None
        self.mergers: list = []
        names = iteration(num_microbatches, staged)
        where = node_ids(actors)
        groups = node_groups(nodes if nodes is not None else where)
        if per_node is None:
            per_node = len(groups) > 1
        if not per_node:
            groups = [[r] for r in range(len(actors))]
        try:
            for g in groups:  # a node of one rank needs no merge: the driver reads that rank
                self.mergers.append(None if len(g) == 1 else NodeMerger.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(where[g[0]], soft=False)).remote())
            self.groups = groups  # the ranks of each node merged (one each: the driver reads every rank)
            with InputNode() as plan:
                ranks = []
                for actor in actors:
                    node = plan
                    for name in names:
                        node = getattr(actor, name).bind(node)
                    ranks.append(node)
                outputs = [ranks[g[0]] if m is None else m.merge.bind(plan, *[ranks[r] for r in g])
                           for m, g in zip(self.mergers, groups)]
                homes = [where[g[0]] for g in groups]  # the node each output is written on
                while per_node and len(outputs) > fan_in:
                    outputs, homes = self._merge_again(plan, outputs, homes, fan_in)
            self.outputs = len(outputs)  # what the driver reads per iteration
            self.graph = MultiOutputNode(outputs).experimental_compile()
        except BaseException:
            self.close()
            raise
        self.nap = Nap()
        # One call per rank that fails only when its process ends (`RankShim.until_exit`): the nap
        # waits on them, so that a lost rank ends it at once (actor classes without it: a plain sleep)
        self.exits = [a.until_exit.remote() for a in actors] if all(hasattr(a, "until_exit") for a in actors) else []

    def _merge_again(self, plan, outputs: list, homes: list, fan_in: int) -> tuple[list, list]:
        """One more level of the tree: each `fan_in` consecutive outputs merged on the first's node."""
        merged, merged_homes = [], []
        for i in range(0, len(outputs), fan_in):
            merger = NodeMerger.options(scheduling_strategy=NodeAffinitySchedulingStrategy(homes[i], soft=False)).remote()
            self.mergers.append(merger)
            merged.append(merger.merge.bind(plan, *outputs[i:i + fan_in]))
            merged_homes.append(homes[i])
        return merged, merged_homes

    def _submit(self, plan: dict):
        return self.graph.execute(plan)

    def collect(self, pending: Pending, queued: bool = True) -> list[dict]:
        """One result per node (a merge of its ranks', see `results.merge`), or per rank."""
        wake = self.nap.wake_at(pending.submitted_at, time.time(), queued)
        if wake is not None:
            rest(self.exits, wake - time.time())
        elif not self.nap.recent and pending.step is not None:  # the first two: nothing to guess from
            self._until_finished(pending.step)
        woke = time.time()
        out = ray.get(pending.handle, timeout=self.timeout_s)
        self.nap.observe(out, pending.submitted_at, woke, time.time())
        return out

    def _until_finished(self, step: int) -> None:
        """An iteration no nap can guess (the first, whose time sets none, and the second): ask
        the ranks how far they are (`progress`, answered from a thread of their own, as the
        watchdog asks: a wait on an object, which does not spin) until each has finished `step`,
        or each that has not is in that step but in no phase, or one has begun a later step
        without finishing it (it raised: the channel's read reports it), at most every
        POLL_MAX_S. Measured at 2 ranks on 2 cores (3M GPT, 4 x
        4,096 tokens a step): the first step took 8.6 s with the driver spinning on its result,
        4.6 s asking, against 4.1 s a steady step."""
        wait, idle_before = POLL_MIN_S, False
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                answers = ray.get([a.progress.remote() for a in self.actors], timeout=self.timeout_s)
            except (ray.exceptions.RayError, AttributeError):
                return  # a rank is gone (the channel's read reports it), or answers no progress
            finished = [a.get("finished") is not None and a["finished"] >= step for a in answers]
            # a rank in a later step that never finished this one: this one raised there (the driver queued the
            # next plan, whose first phase ran on the error); idle: in this step, in no phase, not finished: it
            # raised (twice: not a gap between phases)
            past = any(not done and (a.get("step") or 0) > step for done, a in zip(finished, answers))
            idle = all(done or (a.get("step") == step and a.get("phase") is None) for done, a in zip(finished, answers))
            if all(finished) or past or (idle and idle_before):
                return
            idle_before = idle
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.teardown()
            self.graph = None
        for m in self.mergers:
            if m is not None:
                ray.kill(m)
        self.mergers = []


def rest(exits: list, seconds: float) -> bool:
    """Sleep `seconds`, or until one of `exits` (ranks' `until_exit` calls) fails: that rank's
    process has ended (measured: the wait wakes ~15 ms after a SIGKILL, and spins no core; a dead
    rank's iteration then fails its read at once). Whether one did."""
    if seconds <= 0:
        return False
    if not exits:
        time.sleep(seconds)
        return False
    ended, _ = ray.wait(exits, num_returns=1, timeout=seconds)
    return bool(ended)


def _work_s(results: list) -> float | None:
    """How long the slowest rank worked on this iteration, from the phase times it reports
    (each rank's, or each merged group's slowest)."""
    times = [r["work_s"] if "work_s" in r else work_s(r["phase_s"])
             for r in results if isinstance(r, dict) and ("work_s" in r or "phase_s" in r)]
    return max(times) if times and len(times) == len(results) else None


class ChainedDispatch(_Dispatch):
    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0, staged: bool = False):
        self.actors, self.names, self.timeout_s = actors, iteration(num_microbatches, staged), timeout_s

    def _submit(self, plan: dict):
        refs = []
        for actor in self.actors:
            ref = plan
            for name in self.names:
                ref = getattr(actor, name).remote(ref)
            refs.append(ref)
        return refs


class PerPhaseDispatch(_Dispatch):
    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0, staged: bool = False):
        self.actors, self.names, self.timeout_s = actors, iteration(num_microbatches, staged), timeout_s

    def _submit(self, plan: dict):
        return plan  # nothing runs until collect: one phase at a time

    def collect(self, pending: Pending, queued: bool = True) -> list[dict]:
        outs = [pending.handle] * len(self.actors)
        for name in self.names:
            outs = ray.get(
                [getattr(a, name).remote(o) for a, o in zip(self.actors, outs)], timeout=self.timeout_s
            )
        return outs


DISPATCHERS = {"compiled": CompiledDispatch, "chained": ChainedDispatch, "per_phase": PerPhaseDispatch}
