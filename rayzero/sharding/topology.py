"""Who talks to whom: pure arithmetic from world size, rank and `dp_outer` to named axes.

The data-parallel ranks form a grid of `dp_outer` replicas x `dp_shard` shards, replica-major,
so a shard group is a run of consecutive ranks (on one node when ranks are packed per node):

    world 4, dp_outer 2:   shard groups [0, 1] [2, 3]     replicate groups [0, 2] [1, 3]
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("shard", "replicate")


@dataclass(frozen=True)
class Topology:
    """A rank's place on the named axes. `rank` is the global rank; `shard_rank` its index in
    its shard group; `replica_rank` its index in its replicate group."""

    world_size: int
    rank: int
    dp_outer: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world size {self.world_size}")
        if self.dp_outer < 1 or self.world_size % self.dp_outer:
            raise ValueError(f"dp_outer {self.dp_outer} does not divide world size {self.world_size}")

    @property
    def dp_size(self) -> int:
        """Every rank is a data-parallel rank: the global batch splits across all of them."""
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_shard(self) -> int:
        return self.world_size // self.dp_outer

    @property
    def shard_rank(self) -> int:
        return self.rank % self.dp_shard

    @property
    def replica_rank(self) -> int:
        return self.rank // self.dp_shard

    def size(self, axis: str) -> int:
        return {"shard": self.dp_shard, "replicate": self.dp_outer}[axis]

    def axis_rank(self, axis: str) -> int:
        return {"shard": self.shard_rank, "replicate": self.replica_rank}[axis]

    def groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis` (every rank must create all of them,
        in this order, for torch.distributed)."""
        s, o = self.dp_shard, self.dp_outer
        if axis == "shard":
            return [[r * s + i for i in range(s)] for r in range(o)]
        if axis == "replicate":
            return [[r * s + i for r in range(o)] for i in range(s)]
        raise ValueError(f"unknown axis {axis!r}; axes are {AXES}")

    def my_group(self, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if self.rank in g)
