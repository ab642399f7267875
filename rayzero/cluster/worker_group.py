"""Ranks in Ray actors: placement group → one actor per bundle → rendezvous, in that order."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayzero.cluster.spares import Spare, Spares, free_bundles, remove_groups

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
        KEPT.wait_ahead()
        if key == KEPT.ahead_key and KEPT.ahead_error is not None:  # it waited the placement's time: said so
            error, KEPT.ahead_key, KEPT.ahead_error = KEPT.ahead_error, None, None
            raise error
        if keep or key == KEPT.ahead_key:
            group = KEPT.take(key, actor_args, same_node)
            if group is not None:
                group.keep_as = key if keep else None
                return group
        KEPT.discard()  # placed otherwise: the kept ranks' room is this run's
        group = cls.place(actor_cls, num_workers, bundle, actor_args, strategy, placement_timeout_s, same_node)
        group.keep_as = key if keep else None
        return group

    @classmethod
    def place(cls, actor_cls, num_workers: int, bundle: dict[str, float], actor_args: Callable[[int], tuple],
              strategy: str, placement_timeout_s: float, same_node: int) -> "WorkerGroup":
        """The placement group, then one actor in each bundle (`create`, without the kept ranks)."""
        bundles = [dict(bundle) for _ in range(num_workers)]
        pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=placement_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise PlacementError(unplaced(num_workers, bundle, strategy, placement_timeout_s)) from None
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
        return cls(actors, pg)

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
        remove_groups(groups)


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
    actors with it).

    Online RL's rollout actors are kept beside them (`rollouts`: idle, in their placement
    group) for the next run that is placed alike and samples through as many actors of the
    same bundle (`take_rollouts`, each actor made anew: `RolloutWorker.renew`); they go with
    the ranks, and are killed too at the start of a run that has no rollouts (`discard_rollouts`)."""

    def __init__(self):
        self.group: WorkerGroup | None = None  # its `keep_as`: the placement it serves
        self.cluster: str | None = None  # the Ray connection it was kept on (`_cluster`)
        # The address of a Ray connection a run made and left open for the kept ranks (they end
        # with it); `release` shuts it down. None: the connection, if any, is not the kept ranks'.
        self.connection: str | None = None
        # A placement begun ahead of its run (`begin_ahead`, `place_ahead`): set once it is done;
        # the placement it made (its key), when it began in the run's start-up clock, and its
        # PlacementError, until the run's placement takes them.
        self.ahead: threading.Event | None = None
        self.ahead_key: tuple | None = None
        self.ahead_began_s: float | None = None
        self.ahead_error: PlacementError | None = None
        self.rollouts: tuple | None = None  # (key, placement group, actors) of the rollout actors kept

    def wait_ahead(self) -> None:
        """Until a placement begun ahead of the run (if any) is done."""
        if self.ahead is not None:
            self.ahead.wait()

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

    def serves(self, key, same_node: int) -> bool:
        """Whether the kept group was placed as `key` asks, on this process's present Ray, with
        each run of `same_node` ranks on one node."""
        return (self.group is not None and key == self.group.keep_as and self._cluster() == self.cluster
                and not split_groups(self.group.pg, len(self.group.actors), same_node))

    def ready(self, key, same_node: int = 1, timeout_s: float = 2.0) -> bool:
        """Whether a group placed as `key` asks is kept (`serves`) and each of its ranks answers;
        a kept group with a rank that does not (it died while idle) is discarded."""
        if not self.serves(key, same_node):
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
        """The kept group if it serves (`serves`), each rank renewed with `actor_args(rank)`;
        None otherwise (a group that cannot be renewed is killed)."""
        if not self.serves(key, same_node):
            return None
        group, self.group, self.ahead_key = self.group, None, None
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
        """Kill the kept ranks (and rollout actors) and free their bundles (the Ray connection stays)."""
        group, self.group = self.group, None
        if group is not None and self._cluster() == self.cluster:
            group.kill()
        self.discard_rollouts()

    def keep_rollouts(self, key: tuple, pg, actors: list) -> None:
        """Rollout actors, idle, in their placement group `pg`, for a run whose rollouts are `key`."""
        self.discard_rollouts()
        self.rollouts = ((*key, self._cluster()), pg, list(actors))

    def take_rollouts(self, key: tuple, actor_args: Callable[[int], tuple[Any, ...]],
                      timeout_s: float = 60.0) -> tuple | None:
        """(placement group, actors) of the rollout actors kept for `key`, each renewed with
        `actor_args(i)`; None if none serve (those kept for another key are killed)."""
        if self.rollouts is None or self.rollouts[0] != (*key, self._cluster()):
            self.discard_rollouts()
            return None
        (_, pg, actors), self.rollouts = self.rollouts, None
        try:
            ray.get([a.renew.remote(*actor_args(i)) for i, a in enumerate(actors)], timeout=timeout_s)
        except Exception as e:  # one died while idle, or hangs: start afresh
            log.info("the kept rollout actors could not be renewed (%s); starting new ones", e)
            kill_actors(actors, pg)
            return None
        return pg, actors

    def discard_rollouts(self) -> None:
        """Kill the kept rollout actors and free their bundles, if Ray is still the one they live in."""
        kept, self.rollouts = self.rollouts, None
        if kept is not None and kept[0][-1] == self._cluster():
            kill_actors(kept[2], kept[1])


KEPT = Kept()


def kill_actors(actors: list, pg=None) -> None:
    """Kill `actors` (those already gone too) and free their placement group `pg`, if any."""
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception as e:  # noqa: BLE001 (already gone)
            log.debug("kill failed: %s", e)
    if pg is not None:
        try:
            remove_groups([pg])
        except Exception as e:  # noqa: BLE001 (already removed)
            log.debug("removing a placement group: %s", e)


def begin_ahead(cfg, began_s: float) -> bool:
    """Whether the ranks of a run of `cfg` are placed ahead of it (`place_ahead`), and if so, what
    the run's placement is to wait for: said before the driver goes on from its Ray's start."""
    from rayzero.workers.actor import RankActor

    worlds, c = cfg.world_sizes(), cfg.cluster
    if len(worlds) > 1 or KEPT.group is not None or KEPT.rollouts is not None:  # elastic: the cluster's room decides its world
        return False
    KEPT.ahead, KEPT.ahead_error = threading.Event(), None
    KEPT.ahead_key, KEPT.ahead_began_s = placement_key(RankActor, worlds[0], c.bundle, c.placement_strategy), began_s
    return True


def place_ahead(cfg) -> None:
    """Place a run's ranks and start their processes before the run gets to it (`begin_ahead`
    said so): the driver has just connected to Ray and its own imports and checks go on, while
    the processes import torch and the model's code. The group is left with `KEPT`, each process
    without a rank, until the run's placement takes it and renews every one with the run's
    arguments (`Kept.take`); a run placed otherwise kills it. A placement that fails within
    `cluster.placement_timeout_s` is the run's error, raised where it places its ranks; any
    other failure leaves the placement to the run."""
    actor_cls, world, bundle, strategy = KEPT.ahead_key
    try:
        group = WorkerGroup.place(actor_cls, world, dict(bundle), lambda r: (None, None, world, "", None), strategy,
                                  cfg.cluster.placement_timeout_s, cfg.mesh().size("node"))
        group.keep_as = KEPT.ahead_key
        KEPT.keep(group)
    except PlacementError as e:
        KEPT.ahead_error = e
    except Exception as e:  # noqa: BLE001 (the run's own placement tries again, and says why)
        log.debug("placing the ranks ahead of the run failed: %s", e)
        KEPT.ahead_key = None
    finally:
        KEPT.ahead.set()


def release_ranks() -> None:
    """Release the rank processes kept by a run with `cluster.keep_ranks` (none: nothing to do)."""
    KEPT.release()


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
    def placed_ahead(actor_cls, world: int, bundle: dict[str, float], strategy: str = "PACK",
                     same_node: int = 1) -> float | None:
        """When a placement begun ahead of the run (`place_ahead`) as these ranks are asked began,
        in the start-up's clock; None if none did (`create` waits for it, and takes its group)."""
        return KEPT.ahead_began_s if KEPT.ahead_key == placement_key(actor_cls, world, bundle, strategy) else None

    @staticmethod
    def free(bundle: dict[str, float], settle_s: float = 2.0) -> int:
        return free_bundles(bundle, settle_s=settle_s)

    @staticmethod
    def start_spares(actor_cls, count: int, bundle: dict[str, float], actor_args) -> "Spares":
        return Spares.start(actor_cls, count, bundle, actor_args)


def unplaced(num_workers: int, bundle: dict, strategy: str, timeout_s: float) -> str:
    """Why `num_workers` bundles of `bundle` were not placed: what the cluster has, what of it is
    free (other jobs hold the rest), and what to change for the resource that is short."""
    total, free = ray.cluster_resources(), ray.available_resources()
    kinds = [k for k in ("CPU", "GPU") if bundle.get(k)]
    has = ", ".join(f"{free.get(k, 0.0):g} of {total.get(k, 0.0):g} {k} free" for k in kinds)
    short = [k for k in kinds if free.get(k, 0.0) < num_workers * bundle[k]]
    if short:
        fixes = ["fewer workers (cluster.num_workers)", *(["a smaller cluster.cpus_per_worker"] if "CPU" in short else []),
                 f"a cluster with more {' and '.join(short)}"]
    else:  # enough in all, not on the nodes as the strategy places them
        fixes = ["another cluster.placement_strategy", "more nodes"]
    return (f"could not place cluster.num_workers={num_workers} workers of {bundle} each (strategy {strategy}) "
            f"within cluster.placement_timeout_s={timeout_s:g}s: they need "
            + ", ".join(f"{num_workers * bundle[k]:g} {k}" for k in kinds)
            + f"; the cluster has {has}. Use {', '.join(fixes[:-1])} or {fixes[-1]}.")
