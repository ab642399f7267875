"""Ranks in Ray actors: placement group → one actor per bundle → rendezvous, in that order."""

from __future__ import annotations

import logging
import time
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
    ) -> "WorkerGroup":
        """Reserve one `bundle` per rank, then start `actor_cls(*actor_args(rank))` in each.
        `same_node`: each run of that many consecutive ranks (a tensor-parallel group) must
        have landed on one node; PlacementError naming the groups that did not."""
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
            nodes = placement_group_table(pg)["bundles_to_node_id"]
            split = [list(range(g, g + same_node)) for g in range(0, num_workers, same_node)
                     if len({nodes[i] for i in range(g, g + same_node)}) > 1]
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

    def wait_started(self) -> None:
        """Until every rank's process is up: started, its modules imported, its `Rank` made
        (the seconds a new process spends importing torch come here, not in the rendezvous)."""
        ray.get([a.progress.remote() for a in self.actors])

    def rendezvous(self) -> list[dict]:
        """Rank 0 picks an address and free port; every rank joins the process group there."""
        addr, port = ray.get(self.actors[0].address.remote())
        return ray.get([a.setup.remote(addr, port) for a in self.actors])

    def call(self, name: str, *args) -> list:
        """Every rank's answer to its call `name(*args)`, in rank order (a rank's error raises)."""
        return ray.get([getattr(a, name).remote(*args) for a in self.actors])

    def dead_ranks(self, timeout_s: float = 2.0) -> list[tuple[int, BaseException]]:
        """(rank, why) for each rank actor that is dead, asking every one of them."""
        refs = [a.progress.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for r, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    dead.append((r, e))
        return dead

    def shutdown(self, graceful_timeout_s: float = 10.0) -> None:
        """Close the process groups if possible, then kill every actor and free the bundles."""
        if self.actors:
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=graceful_timeout_s)
            except Exception as e:  # a dead or hung rank: kill regardless
                log.debug("graceful close failed: %s", e)
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
        if self.pg is not None:
            pg, self.pg = self.pg, None
            remove_placement_group(pg)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and placement_group_table(pg).get("state") != "REMOVED":
                time.sleep(0.01)


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
    def free(bundle: dict[str, float], settle_s: float = 2.0) -> int:
        return free_bundles(bundle, settle_s=settle_s)
