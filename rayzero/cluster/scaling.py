"""How many ranks the run trains at: the one owner of every world-size choice.

A pure policy (no Ray): the controller asks it where to start, which worlds to try when it
places a group, which world to come back at after a failure, and whether to grow back at a
checkpoint, and tells it only what it knows (the world that failed, how many ranks the cluster
could hold now). The worlds it chooses from are `RootConfig.world_sizes()`: the configured
world, then (elastic, `cluster.min_workers`) every smaller one that divides the global batch and
keeps the mesh whole.
"""

from __future__ import annotations

from rayzero.config import RootConfig


class ScalingPolicy:
    def __init__(self, worlds: list[int]):
        """`worlds`: the valid world sizes, largest (the configured one) first."""
        if not worlds or sorted(worlds, reverse=True) != list(worlds):
            raise ValueError(f"world sizes must be given largest first, got {worlds}")
        self.worlds = list(worlds)

    @classmethod
    def from_config(cls, cfg: RootConfig) -> "ScalingPolicy":
        return cls(cfg.world_sizes())

    @property
    def elastic(self) -> bool:
        return len(self.worlds) > 1

    def start(self) -> int:
        """The world the run places first: the configured one."""
        return self.worlds[0]

    def to_place(self, world: int) -> list[int]:
        """The worlds to try, in order, when placing a group meant to be `world` ranks: it,
        then (elastic) each smaller valid one, should the cluster not hold it."""
        return [w for w in self.worlds if w <= world]

    def after_failure(self, world: int, capacity: int) -> int:
        """The world to place after a failure of a group of `world` ranks, the cluster holding
        `capacity` free ranks now (the failed group already released): the largest valid world
        that fits, if smaller than `world` (a shrink); else `world`, or the configured world if
        it fits again. Too little room for any valid world: `world` again (placement waits for
        the room to come back, then shrinks if it must)."""
        fits = [w for w in self.worlds if w <= capacity]
        if not fits:
            return world
        return fits[0] if fits[0] < world else max(world, fits[0])

    def grow_to(self, world: int, free: int) -> int | None:
        """At a checkpoint of a group of `world` ranks with `free` more ranks' room in the cluster:
        the biggest valid world that fits, or None (already the configured world, or no room)."""
        bigger = [w for w in self.worlds if world < w <= world + free]
        return bigger[0] if bigger else None
