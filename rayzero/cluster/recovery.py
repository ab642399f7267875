"""After a failure: the state that finds who failed and how, asks the failure policy, and
either places a fresh group or ends the run with one message naming the commit to resume from."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray

from rayzero.checkpoint.manifest import CheckpointError
from rayzero.cluster.failure import (ERROR, PLACEMENT, Decision, Failure, TrainingFailed, diagnose, first_line,
                                     unwrap)
from rayzero.cluster.states import Building, Live, Placing, State, Training, held

log = logging.getLogger(__name__)


@dataclass(repr=False)
class Recovering(State):
    """After a failure in state `failed`: who failed and how, the group torn down, the failure
    policy asked; then the backoff and a new placement, or (the policy gives up) the run ends
    with one message naming the commit to resume from."""

    error: Exception
    failed: State
    doing = "recovering"

    @property
    def code(self) -> str:  # recovering belongs to the state that failed, until the next begins
        return self.failed.code

    @property
    def live(self) -> Live | None:
        return held(self.failed)

    def next(self, run) -> State:
        rec, exc, live = run.record, self.error, self.live
        failure = self.diagnose(run)
        commits = run.checkpoints.commits if run.checkpoints is not None else 0
        streak = rec.failed(commits)
        policy = run.failure_policy
        # Only a group that failed while training can take spares in: its other ranks are in a
        # phase, whose collectives `disconnect` breaks. Elsewhere they may be waiting on the lost
        # rank where nothing gives up soon (the rendezvous, whose store the lost rank may host;
        # a replacement already under way): a fresh group, then.
        spares = len(run.spares) if run.spares is not None and isinstance(self.failed, Training) else 0
        replace = policy.replaces(failure, len(rec.failures), rec.world, spares) if spares else None
        if replace is not None:  # the other ranks keep their processes: nothing to tear down here
            run.record_failure(failure, replace)
            return Replacing(live, failure)
        if live is not None:
            live.release(kill=True)
        if run.spares is not None:
            run.spares.forget_owed()  # their bundles were the killed group's
        run.clock.mark("teardown")
        if failure.kind == PLACEMENT and not rec.failures and not run.history.losses:
            raise exc  # the very first placement: the request itself cannot be met
        capacity = run.free_ranks(settle_s=2.0)
        decision = policy.decide(failure, len(rec.failures), streak, rec.world, capacity)
        run.record_failure(failure, decision)
        if decision.action == "give_up":
            cause = unwrap(exc)
            if failure.kind == ERROR and isinstance(cause, CheckpointError):
                raise cause from None  # a user's mistake, already worded as one
            raise TrainingFailed(give_up_message(run, failure, decision)) from exc
        time.sleep(decision.delay_s)
        run.clock.mark("backoff")
        return Placing(decision.world_size)

    def diagnose(self, run) -> Failure:
        """Who failed, where, and how: the watchdog's finding if it fired, else `diagnose` of
        the dead ranks and the exception."""
        detected = time.time()
        live, rec, exc = self.live, run.record, self.error
        wd = live.watchdog if live is not None else None
        if wd is not None:
            wd.stop()
        if wd is not None and wd.fired is not None:
            failure = wd.fired
        else:
            rank = phase = None
            if isinstance(exc, ray.exceptions.RayTaskError):
                rank = rec.pids.get(getattr(exc, "pid", None))
                phase = (getattr(exc, "function_name", "") or "").rpartition(".")[2] or None
            dead = live.group.dead_ranks() if live is not None and live.group is not None and live.group.actors else []
            training = isinstance(self.failed, Training)
            failure = diagnose(exc, rank, phase, dead=dead, last_seen=wd.last if wd is not None else {},
                               step=rec.step if training else None, doing=self.failed.doing)
            if isinstance(self.failed, Replacing) and dead and {r for r, _ in dead} <= set(self.failed.failure.lost):
                # The ranks it was replacing are still dead in the group: the replacement's own
                # error is what is new. Still their loss (a fresh group is placed), said as such.
                lost = self.failed.failure.lost
                failure.message = (f"replacing rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                                   f"with warm spares failed: {first_line(exc)}")
                failure.detail = str(unwrap(exc)).strip()
        failure.detected_at = detected
        run.clock.start(failure, detected)
        run.clock.mark("diagnose")
        if failure.kind != ERROR:  # an error in the training code is reported once, as the run ends
            log.warning("failure (%s): %s", failure.kind, failure.message)
        return failure


def give_up_message(run, failure: Failure, decision: Decision) -> str:
    restarts = len(run.record.failures) - 1
    last = run.last_checkpoint()
    where = (f"The last committed checkpoint is {last}; run the same command again to resume from it"
             if last else "No checkpoint was committed")
    more = failure.detail.splitlines()[1:] if failure.kind == ERROR else []
    return (f"training stopped after {restarts} restart{'s' if restarts != 1 else ''} "
            f"({decision.reason}): {failure.message}"
            + "".join(f"\n  {line}" for line in more) + f"\n{where}.")


# A survivor breaks out of its collectives and leaves its broken process group in well under
# a second; one that takes longer is stuck (an upload that does not finish, a phase that does
# not return), and the run falls back to a fresh group.
LEAVE_TIMEOUT_S = 10.0
# How long a replacement waits for a spare that is still warming up (importing torch).
SPARE_WAIT_S = 60.0


@dataclass(repr=False)
class Replacing(State):
    """Warm spares take the places of the ranks `failure.lost`: the surviving ranks break out of
    their collectives, the iteration's graph is torn down (it holds every rank), the surviving
    ranks leave their broken process group but keep their processes, each spare is given a lost rank's mesh coordinates, and the same group
    goes back to Building (a fresh rendezvous) and Resuming (the last commit, as a restart
    would: the result stays bitwise that of the unbroken run). The spares are replenished in
    the lost ranks' bundles once the group has trained a step again (`Spares.owe`). Anything
    failing here, or in the Building and Resuming after it, is a new failure, and Recovering
    kills the group and places a fresh one (see there)."""

    live: Live
    failure: Failure
    code = "REPLACE"
    doing = "replacing lost ranks with warm spares"

    def next(self, run) -> State:
        live, rec, lost = self.live, run.record, self.failure.lost
        group = live.group
        # The other ranks' collectives first: on gloo some of them wait on live peers until the
        # collective timeout (see workers/disconnect.py), and the graph cannot be torn down
        # while a rank is stuck inside one of its phases.
        group.disconnect(lost, timeout_s=LEAVE_TIMEOUT_S)
        dispatch, live.dispatch = live.dispatch, None
        if dispatch is not None:
            dispatch.close()
        run.clock.mark("teardown")
        uploads = group.leave(lost, timeout_s=LEAVE_TIMEOUT_S)
        if run.checkpoints is not None:  # a commit the lost ranks had finished their part of
            run.checkpoints.add_uploads([u for r in uploads for u in r.get("uploads", [])])
        run.clock.mark("leave")
        for rank in lost:
            spare = run.spares.take(timeout_s=SPARE_WAIT_S)
            if spare is None:
                raise RuntimeError(f"no warm spare became ready within {SPARE_WAIT_S:g}s to replace rank {rank}")
            pid = group.take_in(rank, spare, rec.world)
            run.spares.owe(group.vacant_bundle())  # started once the group trains again
            rec.replacements.append({"rank": rank, "step": self.failure.step, "pid": pid})
            log.warning("a warm spare (pid %s) takes the place of rank %d", pid, rank)
        live.watchdog = run.make_watchdog(group.actors, on_fire=group.kill)
        run.clock.mark("replacement")
        return Building(live)
