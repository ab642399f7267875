"""What went wrong, and what to do about it.

`diagnose` turns whatever the controller caught into a `Failure` (which rank, which phase, what
kind of fault); `FailurePolicy.decide` turns a failure into a `Decision`: restart at the same
world size, shrink to a smaller one (elastic), or give up. The controller carries it out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import ray
import torch.distributed as dist

from rayzero.storage import StorageError, permanent
from rayzero.cluster.scaling import ScalingPolicy
from rayzero.cluster.worker_group import PlacementError
from rayzero.config import RootConfig

# Kinds of failure. All but "error" are faults of the machinery (a process, the network, the
# storage, the cluster) that a fresh group can get past; "error" is an exception out of the
# training code itself (a bad checkpoint, a bug), which a restart would only repeat.
RANK_DIED, HANG, COLLECTIVE, STORAGE, PLACEMENT, ERROR = (
    "rank_died", "hang", "collective", "storage", "placement", "error")
RETRYABLE = (RANK_DIED, HANG, COLLECTIVE, STORAGE, PLACEMENT)

# A torch.distributed failure that reaches Python as a plain RuntimeError (gloo's wording).
_COLLECTIVE_WORDS = ("gloo", "nccl", "connection closed by peer", "connection reset", "broken pipe",
                     "timed out", "socket", "process group")


class TrainingFailed(RuntimeError):
    """The policy gave up; the message names the cause and the last committed checkpoint."""


class Stopped(KeyboardInterrupt):
    """An interrupt (Ctrl-C, a notebook's stop button) or a termination (SIGTERM: `ray job
    stop`, Kubernetes stopping a pod) ended the run cleanly: where it was, and the checkpoint a
    rerun resumes from. `finishing`: after the last step, while the run was finishing (its
    final commit, weights, MLflow). `signal`: the signal that stopped it (SIGINT for Ctrl-C and
    `Controller.stop`)."""

    def __init__(self, step: int | None, checkpoint: str | None, finishing: bool = False,
                 signal: int = 2):
        self.step, self.checkpoint, self.signal = step, checkpoint, signal
        how = "stopped" if signal == 2 else "terminated (SIGTERM): stopped"
        at = (f"{how} after the last step, while the run was finishing" if finishing else
              f"{how} at step {step}" if step is not None else f"{how} before training began")
        where = (f"last checkpoint {checkpoint}; run the same command again to resume" if checkpoint
                 else "no checkpoint was committed")
        super().__init__(f"{at}; {where}")


@dataclass
class Failure:
    kind: str
    message: str  # one line: who, where, what
    detail: str = ""  # the error's whole message
    rank: int | None = None
    lost: list[int] = field(default_factory=list)  # every rank found dead (a node may take several)
    phase: str | None = None
    step: int | None = None  # the iteration (0-based) the rank was in
    detected_at: float = 0.0  # time.time() when the controller caught it
    decision: str = ""  # what the policy decided: replace, restart, shrink, give_up
    world_size: int | None = None  # the world placed next
    timings: dict[str, float] = field(default_factory=dict)  # recovery, filled in as it goes

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    action: Literal["replace", "restart", "shrink", "give_up"]
    world_size: int  # the world to train at next (replace, restart, shrink)
    delay_s: float  # backoff before placing
    reason: str


class FailurePolicy:
    """`failure.max_restarts` recoveries (−1: unlimited) with exponential backoff that resets
    once a checkpoint commits. Whether to go on is this policy's; at how many ranks is the
    scaling policy's (a smaller world when the cluster can no longer hold the current one and
    `cluster.min_workers` allows it). Lost ranks that warm spares can stand in for are
    replaced, at once, with no backoff: the other ranks keep their processes."""

    def __init__(self, cfg: RootConfig, scaling: ScalingPolicy | None = None):
        self.max_restarts = cfg.failure.max_restarts
        self.backoff_s, self.backoff_max_s = cfg.failure.backoff_s, cfg.failure.backoff_max_s
        self.scaling = scaling or ScalingPolicy.from_config(cfg)

    def replaces(self, failure: Failure, restarts: int, world: int, spares: int) -> Decision | None:
        """Asked first, before the group is released: replace the lost ranks with warm spares, if
        the failure is only that (ranks found dead, no more than the `spares` ready) and
        restarts remain; else None, and `decide` says what then."""
        if failure.kind != RANK_DIED or not failure.lost or len(failure.lost) > spares or self._exhausted(restarts):
            return None
        who = f"rank{'s' if len(failure.lost) > 1 else ''} {', '.join(map(str, failure.lost))}"
        return Decision("replace", world, 0.0, f"warm spares take the place of {who}")

    def decide(self, failure: Failure, restarts: int, streak: int, world: int, capacity: int) -> Decision:
        """When no spare takes the lost ranks' places (`replaces`): `restarts` so far, `streak`
        failures since the last commit, the `world` that failed and how many ranks the cluster
        could `capacity` place now (the failed group released)."""
        if failure.kind not in RETRYABLE:
            return Decision("give_up", world, 0.0, "the error is in the training code, not a lost resource")
        if failure.kind == STORAGE and permanent(failure.message):
            return Decision("give_up", world, 0.0, "the storage refuses, which no restart changes: check "
                            "checkpoint.dir and the checkpoint.s3_* settings, or the AWS_* variables")
        if self._exhausted(restarts):
            return Decision("give_up", world, 0.0, f"failure.max_restarts={self.max_restarts} reached")
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** max(0, streak - 1))
        then = self.scaling.after_failure(world, capacity)
        if then < world:
            return Decision("shrink", then, delay, f"the cluster can place {capacity} ranks now")
        # Enough room (or none at all yet: placement waits for it, then shrinks if it can).
        return Decision("restart", then, delay, "a fresh group")

    def _exhausted(self, restarts: int) -> bool:
        return self.max_restarts >= 0 and restarts >= self.max_restarts


def classify(exc: BaseException) -> str:
    if isinstance(exc, PlacementError):
        return PLACEMENT
    if isinstance(exc, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)):
        return RANK_DIED
    if isinstance(exc, (ray.exceptions.GetTimeoutError, ray.exceptions.RayChannelTimeoutError)):
        return HANG
    cause = unwrap(exc)
    if isinstance(cause, ray.exceptions.RayActorError):
        return RANK_DIED
    if isinstance(cause, (dist.DistError, ray.exceptions.RayChannelError)):
        return COLLECTIVE
    if isinstance(cause, StorageError):
        return STORAGE
    if isinstance(cause, RuntimeError) and any(w in str(cause).lower() for w in _COLLECTIVE_WORDS):
        return COLLECTIVE
    return ERROR


def diagnose(exc: BaseException, rank: int | None, phase: str | None, dead: list[tuple[int, BaseException]],
             last_seen: dict[int, dict], step: int | None, doing: str) -> Failure:
    """Who failed, where, and how, when the watchdog did not fire: a dead rank if any (a lost
    member makes the others' collectives fail too: the dead one is the cause), else the
    exception, raised in `rank`'s `phase` when known. `last_seen`: the watchdog's last answer
    per rank; `doing`: what the run was doing, for a failure outside a rank."""
    kind = classify(exc)
    cause = unwrap(exc)  # an error of the driver's own work may say what it was doing, and for which step
    doing, step = getattr(cause, "doing", doing), step if getattr(cause, "step", None) is None else cause.step
    if dead:
        kind, rank = RANK_DIED, dead[0][0]
        exc = dead[0][1]
        # Where a dead rank was is only what the watchdog last saw (it asks every second):
        # said as such, and not at all if it has not asked since the start.
        seen = last_seen.get(rank, {}).get("phase")
        phase = seen or phase
        # The driver reads step k with k + 1 already queued: a death it meets while reading k
        # may have come in k + 1, which the watchdog may have seen the rank begin.
        if step is not None and seen:
            step = max(step, last_seen[rank].get("step") or step)
        who = f"rank{'s' if len(dead) > 1 else ''} {', '.join(str(r) for r, _ in dead)} died"
        where = ("" if step is None else f" at step {step}") + (f" (last seen in phase {seen})" if seen else "")
    else:
        who = f"rank {rank} failed" if rank is not None else f"{doing} failed"
        where = (f" in phase {phase}" if phase else "") + (
            "" if step is None else f" of step {step}" if phase else f" at step {step}")
    return Failure(kind, f"{who}{where}: {first_line(exc)}", rank=rank, phase=phase, step=step,
                   detail=str(unwrap(exc)).strip(), lost=[r for r, _ in dead])


def unwrap(exc: BaseException) -> BaseException:
    """The error a rank raised, out of Ray's RayTaskError around it."""
    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


def first_line(exc: BaseException) -> str:
    """The exception's own message, without Ray's wrapping and tracebacks; for a dead actor,
    Ray's reason (its process died, its node died, it was killed…)."""
    e = unwrap(exc)
    text = str(e).strip()
    if isinstance(e, ray.exceptions.RayActorError):  # Ray's text runs to a paragraph: one sentence
        at = text.find("The actor is dead because")
        return f"{type(e).__name__}: {text[max(at, 0):].split('. ')[0].split(': ')[0].rstrip('.')}"
    lines = text.splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()
