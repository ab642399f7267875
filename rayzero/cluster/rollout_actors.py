"""Online RL's rollout actors as a pool: their placement group, one actor a bundle, and what
becomes of them at a run's end (killed, or kept with `cluster.keep_ranks` for the next run in
the same process, `worker_group.KEPT`). What they are asked to do is `rollouts.py`'s."""

from __future__ import annotations

import logging
from typing import Callable

import ray

from rayzero.cluster.worker_group import KEPT, kill_actors

log = logging.getLogger(__name__)


class RolloutActors:
    """`rollout.workers` actors of `rollout.cpus_per_worker` (and `gpus_per_worker`) each, in a
    placement group of their own, made with (cfg, stop_ids, factory, index)."""

    def __init__(self, cfg, stop_ids: list[int], factory=None):
        self.cfg, self.r = cfg, cfg.rollout
        self.stop_ids, self.factory = stop_ids, factory
        self.actors: list = []
        self.pg = None

    def start(self) -> None:
        """Reserve the bundles and start the actors, or take the ones the last run kept (made
        anew: no process start). Once: a second call leaves them be."""
        if self.actors:
            return
        from ray.util.placement_group import placement_group

        kept = KEPT.take_rollouts(self._keep_key(), lambda i: (self.cfg, self.stop_ids, self.factory, i)) \
            if self.cfg.cluster.keep_ranks else None
        if kept is not None:
            self.pg, self.actors = kept
            return
        self.pg = placement_group([dict(self._bundle()) for _ in range(self.r.workers)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=self.cfg.cluster.placement_timeout_s)
        self.actors = [self.actor(i) for i in range(self.r.workers)]

    def actor(self, i: int):
        """A new actor in bundle i (at the start, or replacing a lost one)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rayzero.workers.rollout import RolloutActor

        return RolloutActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            num_cpus=self.r.cpus_per_worker, num_gpus=self.r.gpus_per_worker,
            max_concurrency=self._threads()).remote(self.cfg, self.stop_ids, self.factory, i)

    def close(self, keep: bool = False, idle: Callable[[], bool] = lambda: True) -> None:
        """The actors killed and their bundles freed; or, for a run that ended well with
        `cluster.keep_ranks` (`keep`), kept for the next run once no call of theirs is running
        (`idle`)."""
        if keep and self.cfg.cluster.keep_ranks and self.actors and self.pg is not None and idle():
            KEPT.keep_rollouts(self._keep_key(), self.pg, self.actors)
        elif self.actors or self.pg is not None:
            kill_actors(self.actors, self.pg)
        self.actors, self.pg = [], None

    def _bundle(self) -> dict:
        return {"CPU": self.r.cpus_per_worker, **({"GPU": self.r.gpus_per_worker} if self.r.gpus_per_worker else {})}

    def _keep_key(self) -> tuple:
        """What kept actors must have been started with to serve this run (`cluster.keep_ranks`)."""
        return "rollouts", self.r.workers, tuple(sorted(self._bundle().items())), self._threads()

    def _threads(self) -> int:
        """An actor's threads: its calls waiting their turn each hold one (a round's generate and
        handed-on calls, a weight load), so 2 a round in flight and 4 more; at least 8, so that
        actors kept from a run at lag 0, 1 or 2 serve a run at any of them."""
        return max(8, 2 * self.r.max_lag + 4)
