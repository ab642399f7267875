"""Warm spares (`failure.spares`): standby rank actors, each in a bundle of a rank's shape, that
take a lost rank's place; and what the cluster's free resources hold."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)


def remove_groups(groups: list) -> None:
    """Remove placement groups and wait (5 s at most) until Ray has freed their resources."""
    for pg in groups:
        remove_placement_group(pg)
    deadline = time.monotonic() + 5
    for pg in groups:
        while time.monotonic() < deadline and placement_group_table(pg).get("state") != "REMOVED":
            time.sleep(0.01)


def spares_warning(requested: int, placed: int, bundle: dict[str, float]) -> str | None:
    """The one line a run logs when the cluster holds fewer spares than `failure.spares` asks."""
    if placed >= requested:
        return None
    each = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    return (f"failure.spares={requested}: only {placed} of {requested} spares could be placed ({each} each); "
            f"the cluster has no free resources for more, and a lost rank beyond them restarts every rank")


@dataclass
class Spare:
    """A standby rank actor: where it lives, and its `warm()` call's result."""

    actor: Any
    pg: Any
    bundle_index: int
    owns_pg: bool  # its own single-bundle group (else a vacant bundle of a worker group's)
    warmed: Any  # ObjectRef of `actor.warm()`


class Spares:
    """Warm standby rank actors (`failure.spares`): each started with no rank, in a bundle of a
    rank's shape, and warmed (`Rank.warm`: torch and the model's code loaded), ready to take a
    lost rank's place (`take`, then `WorkerGroup.replace`)."""

    def __init__(self, actor_cls, bundle: dict[str, float], actor_args: Callable[[], tuple[Any, ...]]):
        """`actor_args()`: the spare's constructor arguments, its rank None."""
        self.actor_cls, self.bundle, self.actor_args = actor_cls, dict(bundle), actor_args
        self.spares: list[Spare] = []
        self.owed: list[tuple[Any, int] | None] = []  # homes of spares to start later (`owe`)

    @classmethod
    def start(cls, actor_cls, count: int, bundle: dict[str, float], actor_args: Callable[[], tuple[Any, ...]],
              *, wait_s: float = 2.0) -> "Spares":
        """Up to `count` spares, each in a single-bundle placement group of its own, given
        `wait_s` to be placed; the first that cannot be stops the count (the others would not
        fit either), with one warning naming how many were placed."""
        pool = cls(actor_cls, bundle, actor_args)
        for _ in range(count):
            pg = placement_group([dict(bundle)])
            try:
                ray.get(pg.ready(), timeout=wait_s)
            except GetTimeoutError:
                remove_placement_group(pg)
                break
            pool._start(pg, 0, owns_pg=True)
        warning = spares_warning(count, len(pool.spares), bundle)
        if warning:
            log.warning(warning)
        return pool

    def _start(self, pg, bundle_index: int, owns_pg: bool) -> None:
        actor = self.actor_cls.options(
            num_cpus=self.bundle.get("CPU", 0),
            num_gpus=self.bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
        ).remote(*self.actor_args())
        self.spares.append(Spare(actor, pg, bundle_index, owns_pg, actor.warm.remote()))

    def __len__(self) -> int:
        return len(self.spares)

    def take(self, timeout_s: float = 0.0) -> Spare | None:
        """A spare whose `warm()` has finished, out of the pool, waiting up to `timeout_s` for
        one; None if none is ready. A spare that died is dropped on the way."""
        deadline = time.monotonic() + timeout_s
        while self.spares:
            refs = [s.warmed for s in self.spares]
            ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            spare = self.spares.pop(refs.index(ready[0]))
            try:
                ray.get(spare.warmed)
            except Exception as e:
                log.warning("a spare failed to warm up and is dropped: %s", e)
                self._kill(spare)
                continue
            return spare
        return None

    def replenish(self, home: tuple[Any, int] | None = None) -> None:
        """Start one more spare without waiting for it: in `home` (a worker group's vacant
        bundle, `WorkerGroup.vacant_bundle`) if given, else in a new single-bundle group that
        Ray places when resources allow. `take` offers it once it is warm."""
        if home is not None:
            self._start(home[0], home[1], owns_pg=False)
        else:
            self._start(placement_group([dict(self.bundle)]), 0, owns_pg=True)

    def owe(self, home: tuple[Any, int] | None = None) -> None:
        """`replenish(home)` later, at `settle`: a spare's start (its process importing torch,
        ~1.5 s of CPU) would otherwise run beside the group's rendezvous, load and first step,
        on the same cores. (Measured, benchmarks/recovery.py: 4 ranks on 2 cores.)"""
        self.owed.append(home)

    def settle(self) -> None:
        """Start the spares owed (`owe`): the group they stood in for trains again."""
        owed, self.owed = self.owed, []
        for home in owed:
            self.replenish(home)

    def forget_owed(self) -> None:
        """The group whose bundles the spares were owed in is gone (a restart places a fresh
        one): its vacant bundles with it."""
        self.owed = []

    def _kill(self, spare: Spare) -> None:
        try:
            ray.kill(spare.actor, no_restart=True)
        except Exception as e:
            log.debug("kill of a spare failed: %s", e)
        if spare.owns_pg:
            remove_groups([spare.pg])

    def kill(self) -> None:
        """Kill every spare and remove the placement groups of their own."""
        spares, self.spares, self.owed = self.spares, [], []
        for spare in spares:
            self._kill(spare)


def free_bundles(bundle: dict[str, float], settle_s: float = 2.0) -> int:
    """How many `bundle`s the cluster's free resources hold now, summed over nodes (an upper
    bound for PACK and SPREAD placement). Waits until the view settles: freed resources reach
    it some 100 ms after a placement group is removed."""
    def count() -> int:
        free = ray.available_resources()
        return int(min(free.get(k, 0.0) / v for k, v in bundle.items() if v > 0) + 1e-9)

    deadline = time.monotonic() + settle_s
    last = count()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = count()
        if now == last:
            return now
        last = now
    return last
