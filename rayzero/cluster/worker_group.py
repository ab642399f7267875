"""Ranks in Ray actors: placement group → one actor per bundle → rendezvous, in that order."""

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


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested workers."""


class WorkerGroup:
    def __init__(self, actors: list, pg):
        self.actors = actors
        self.pg = pg
        # Where each rank's actor lives: (placement group, bundle index). Rank r starts in bundle r
        # of `pg`; a spare that takes a rank's place brings its own single-bundle group.
        self.homes: dict[int, tuple[Any, int]] = {r: (pg, r) for r in range(len(actors))}
        self.spare_pgs: list = []  # placement groups of spares that became ranks: removed with `pg`
        self.vacant: list[int] = []  # bundles of `pg` whose rank was replaced: free for a new spare
        self.keep_as = None  # with `cluster.keep_ranks`: its placement's key, under which `shutdown` keeps it

    @classmethod
    def create(
        cls,
        actor_cls,
        num_workers: int,
        bundle: dict[str, float],
        actor_args: Callable[[int], tuple[Any, ...]],
        *,
        strategy: str = "PACK",
        placement_timeout_s: float = 60.0,
        same_node: int = 1,
        keep: bool = False,
    ) -> "WorkerGroup":
        """Reserve one `bundle` per rank, then start `actor_cls(*actor_args(rank))` in each.
        `same_node`: each run of that many consecutive ranks (a tensor-parallel group) must
        have landed on one node; PlacementError naming the groups that did not. `keep`
        (`cluster.keep_ranks`): take the ranks an earlier run of this process kept, if they
        were placed alike, and keep these at `shutdown` (see `Kept`)."""
        key = placement_key(actor_cls, num_workers, bundle, strategy)
        if keep:
            group = KEPT.take(key, actor_args, same_node)
            if group is not None:
                return group
        KEPT.discard()  # placed otherwise: the kept ranks' room is this run's
        bundles = [dict(bundle) for _ in range(num_workers)]
        pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=placement_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            available = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            raise PlacementError(
                f"could not place cluster.num_workers={num_workers} workers of {bundle} each "
                f"(strategy {strategy}) within cluster.placement_timeout_s={placement_timeout_s:g}s; "
                f"the cluster has {available}. Use fewer workers, a smaller "
                f"cluster.cpus_per_worker, or a bigger cluster."
            ) from None
        if same_node > 1:
            split = split_groups(pg, num_workers, same_node)
            if split:
                remove_placement_group(pg)
                raise PlacementError(
                    f"parallel.tp={same_node}: the ranks of tensor-parallel group(s) {split} were placed on "
                    f"different nodes, and their per-layer all-reduces need one node's interconnect; give each "
                    f"node room for a multiple of {same_node} workers (cluster.placement_strategy=PACK places "
                    f"them in order)")
        actors = []
        try:
            for rank in range(num_workers):
                actors.append(
                    actor_cls.options(
                        num_cpus=bundle.get("CPU", 0),
                        num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            pg, placement_group_bundle_index=rank
                        ),
                    ).remote(*actor_args(rank))
                )
        except BaseException:
            cls(actors, pg).shutdown()
            raise
        group = cls(actors, pg)
        group.keep_as = key if keep else None
        return group

    def replace(self, rank: int, actor, pg, bundle_index: int = 0) -> None:
        """Put `actor` (a warm spare, `Spares.take`) at `rank`, in bundle `bundle_index` of `pg`
        (its own group, which this group then removes in `kill`, or a vacant bundle of this
        group's). The lost rank's actor is killed, in case it is hung rather than dead; its
        bundle of the main group becomes vacant (`vacant_bundle`), a spare's own group of a
        rank lost before is removed."""
        old = self.actors[rank]
        try:
            ray.kill(old, no_restart=True)
        except Exception as e:
            log.debug("kill of the lost rank %d failed: %s", rank, e)
        old_pg, old_index = self.homes[rank]
        if old_pg is self.pg:
            self.vacant.append(old_index)
        else:
            self.spare_pgs.remove(old_pg)
            remove_placement_group(old_pg)
        self.actors[rank] = actor
        self.homes[rank] = (pg, bundle_index)
        if pg is not self.pg:
            self.spare_pgs.append(pg)

    def disconnect(self, lost: list[int], timeout_s: float) -> list[dict]:
        """Every rank but the `lost` makes its collectives in flight fail now (`Rank.disconnect`)."""
        return self.call("disconnect", skip=lost, timeout_s=timeout_s)

    def leave(self, lost: list[int], timeout_s: float) -> list[dict]:
        """Every rank but the `lost` leaves its broken process group, keeping its process (see
        `Rank.leave`); their answers (uploads finished and not yet reported). GetTimeoutError
        past `timeout_s`: a rank stuck in a collective with a dead peer."""
        return self.call("leave", skip=lost, timeout_s=timeout_s)

    def take_in(self, rank: int, spare: "Spare", world_size: int) -> int:
        """A warm spare (`Spares.take`) becomes `rank` of `world_size`; returns its pid."""
        answer = ray.get(spare.actor.assign.remote(rank, world_size))
        self.replace(rank, spare.actor, spare.pg, spare.bundle_index)
        return answer["pid"]

    def vacant_bundle(self) -> tuple[Any, int] | None:
        """A bundle of this group's placement group that no rank uses any more, taken off the
        list: (placement group, index), for `Spares.replenish`; None if there is none."""
        return (self.pg, self.vacant.pop(0)) if self.vacant else None

    def wait_started(self) -> None:
        """Until every rank's process is up: started, its modules imported, its `Rank` made
        (the seconds a new process spends importing torch come here, not in the rendezvous)."""
        ray.get([a.progress.remote() for a in self.actors])

    def rendezvous(self, resuming: bool = False) -> list[dict]:
        """Rank 0 picks an address and free port; every rank joins the process group there
        (`resuming`: see `Rank.setup`)."""
        addr, port = ray.get(self.actors[0].address.remote())
        return ray.get([a.setup.remote(addr, port, resuming) for a in self.actors])

    def call(self, name: str, *args, skip=(), timeout_s: float | None = None) -> list:
        """Every rank's answer to its call `name(*args)`, in rank order, but the ranks in `skip`
        (a rank's error raises; GetTimeoutError past `timeout_s`)."""
        return ray.get([getattr(a, name).remote(*args) for r, a in enumerate(self.actors) if r not in skip],
                       timeout=timeout_s)

    def dead_ranks(self, timeout_s: float = 2.0, settle_s: float = 10.0) -> list[tuple[int, BaseException]]:
        """(rank, why) for each rank actor that is dead, asking every one of them. Where some
        are dead and others have not answered in `timeout_s`, those get `settle_s` more: a lost
        node's actors are reported dead one by one, seconds apart on a busy machine, and a
        decision taken on the first alone would replace one rank of a node that took two."""
        refs = [a.progress.remote() for a in self.actors]
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = self._failed(refs, ready)
        if dead and waiting:
            late, _ = ray.wait(waiting, num_returns=len(waiting), timeout=settle_s)
            dead = sorted(dead + self._failed(refs, late), key=lambda d: d[0])
        return dead

    @staticmethod
    def _failed(refs: list, answered: list) -> list[tuple[int, BaseException]]:
        """(rank, why) for each of `answered` that raised: its actor is dead."""
        dead = []
        for r, ref in enumerate(refs):
            if ref in answered:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    dead.append((r, e))
        return dead

    def shutdown(self, graceful_timeout_s: float = 10.0) -> None:
        """Close the process groups if possible, then kill every actor and free the bundles; a
        group to keep (`cluster.keep_ranks`) whose ranks all closed, placed as it was (no spare
        took a rank's place), is kept instead for the next run of this process."""
        closed = False
        if self.actors:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=graceful_timeout_s)
                closed = True
            except Exception as e:  # a dead or hung rank: kill regardless
                log.debug("graceful close failed: %s", e)
        if closed and self.keep_as is not None and not self.spare_pgs and not self.vacant:
            KEPT.keep(self)
            self.actors, self.pg = [], None
            return
        self.kill()

    def kill(self) -> None:
        """Kill every actor at once (no goodbyes: a process group cannot survive a lost member,
        and the others may be stuck in a collective with it) and free the bundles."""
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:
                log.debug("kill failed: %s", e)
        self.actors = []
        groups = [*self.spare_pgs, *([self.pg] if self.pg is not None else [])]
        self.pg, self.spare_pgs, self.vacant = None, [], []
        _remove(groups)


def split_groups(pg, num_workers: int, same_node: int) -> list[list[int]]:
    """The runs of `same_node` consecutive bundles of `pg` (tensor-parallel groups) that Ray
    placed on more than one node."""
    if same_node <= 1:
        return []
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return [list(range(g, g + same_node)) for g in range(0, num_workers, same_node)
            if len({nodes[i] for i in range(g, g + same_node)}) > 1]


def placement_key(actor_cls, num_workers: int, bundle: dict[str, float], strategy: str = "PACK") -> tuple:
    """What a kept group must have been placed with to serve a run (`Kept.take`); a run's
    tensor-parallel groups must also each lie on one node (`split_groups`)."""
    return actor_cls, num_workers, tuple(sorted(bundle.items())), strategy


class Kept:
    """The rank processes a run with `cluster.keep_ranks` left for the next run of this Python
    process: at most one group, closed (no process group, no model), in its placement group.
    A run placed alike takes them and makes each a new `Rank` (`RankShim.renew`): no process
    start, no imports. They are killed, their bundles freed, when a run is placed otherwise or
    runs without `keep_ranks`, by `rayzero.release_ranks()` (which also closes the Ray
    connection a run left open for them), and at the process's end (Ray ends a driver's
    actors with it)."""

    def __init__(self):
        self.group: WorkerGroup | None = None  # its `keep_as`: the placement it serves
        self.cluster: str | None = None  # the Ray connection it was kept on (`_cluster`)
        # The address of a Ray connection a run made and left open for the kept ranks (they end
        # with it); `release` shuts it down. None: the connection, if any, is not the kept ranks'.
        self.connection: str | None = None

    @staticmethod
    def _cluster() -> str | None:
        """This process's Ray connection (its GCS and job), or None without one."""
        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        return f"{context.gcs_address}/{context.get_job_id()}"

    def keep(self, group: "WorkerGroup") -> None:
        self.discard()
        self.group, self.cluster = WorkerGroup(group.actors, group.pg), self._cluster()
        self.group.keep_as = group.keep_as

    def _serves(self, key, same_node: int) -> bool:
        """Whether the kept group was placed as `key` asks, on this process's present Ray, with
        each run of `same_node` ranks on one node."""
        return (self.group is not None and key == self.group.keep_as and self._cluster() == self.cluster
                and not split_groups(self.group.pg, len(self.group.actors), same_node))

    def ready(self, key, same_node: int = 1, timeout_s: float = 2.0) -> bool:
        """Whether a group placed as `key` asks is kept (`_serves`) and each of its ranks answers;
        a kept group with a rank that does not (it died while idle) is discarded."""
        if not self._serves(key, same_node):
            return False
        try:
            ray.get([a.progress.remote() for a in self.group.actors], timeout=timeout_s)
            return True
        except Exception as e:
            log.info("a kept rank is lost (%s); new ones are started", e)
            self.discard()
            return False

    def take(self, key, actor_args: Callable[[int], tuple[Any, ...]], same_node: int = 1,
             timeout_s: float = 30.0) -> "WorkerGroup | None":
        """The kept group if it serves (`_serves`), each rank renewed with `actor_args(rank)`;
        None otherwise (a group that cannot be renewed is killed)."""
        if not self._serves(key, same_node):
            return None
        group, self.group = self.group, None
        try:
            ray.get([a.renew.remote(*actor_args(r)) for r, a in enumerate(group.actors)], timeout=timeout_s)
        except Exception as e:  # a kept rank died while idle, or hangs: start afresh
            log.info("the kept ranks could not be renewed (%s); starting new ones", e)
            group.kill()
            return None
        return group

    def release(self) -> None:
        """Kill the kept ranks and free their bundles, if Ray is still the one they live in; then
        close the Ray connection left open for them."""
        self.discard()
        if self.connection is not None:
            self.connection = None
            ray.shutdown()

    def discard(self) -> None:
        """Kill the kept ranks and free their bundles (the Ray connection stays)."""
        group, self.group = self.group, None
        if group is not None and self._cluster() == self.cluster:
            group.kill()


KEPT = Kept()


def release_ranks() -> None:
    """Release the rank processes kept by a run with `cluster.keep_ranks` (none: nothing to do)."""
    KEPT.release()


def _remove(groups: list) -> None:
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
            _remove([spare.pg])

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


class RayCluster:
    """What the controller asks of the Ray cluster: a group placed, and how much room is free.
    (The controller's states take it as a parameter, so they run without Ray in the tests.)"""

    @staticmethod
    def place(actor_cls, world: int, bundle: dict[str, float], actor_args, **options) -> WorkerGroup:
        return WorkerGroup.create(actor_cls, world, bundle, actor_args, **options)

    @staticmethod
    def kept(actor_cls, world: int, bundle: dict[str, float], strategy: str = "PACK", same_node: int = 1) -> bool:
        """Whether ranks kept by an earlier run (`cluster.keep_ranks`), placed as these are asked,
        are there and answer (see `Kept.ready`)."""
        return KEPT.ready(placement_key(actor_cls, world, bundle, strategy), same_node)

    @staticmethod
    def free(bundle: dict[str, float], settle_s: float = 2.0) -> int:
        return free_bundles(bundle, settle_s=settle_s)

    @staticmethod
    def start_spares(actor_cls, count: int, bundle: dict[str, float], actor_args) -> "Spares":
        return Spares.start(actor_cls, count, bundle, actor_args)
