"""Who talks to whom: pure arithmetic from world size, rank and the axis sizes to a named mesh.

The world is a grid of `replicate` x `shard` x `tp` ranks, outermost first, in the shape of
torchtitan's `ParallelDims`; their product is the world size:

    replicate   hybrid sharding's outer axis (HSDP / Hybrid-FSDP replicas), `sharding.dp_outer`
    shard       data-parallel sharding inside a replica
    tp          tensor parallelism, `parallel.tp`: innermost, so a TP group is a run of
                consecutive ranks (one node's GPUs when ranks are packed per node)
    dp          replicate x shard: every data-parallel rank of one TP index (the batch splits
                over it; a strategy shards and reduces over it where `dp_outer` is 1)

    world 8, dp_outer 2, tp 2:   rank = (replica * shard_size + shard) * tp + tp_rank
        tp groups         [0, 1] [2, 3] [4, 5] [6, 7]
        shard groups      [0, 2] [1, 3] [4, 6] [5, 7]
        replicate groups  [0, 4] [1, 5] [2, 6] [3, 7]
        dp groups         [0, 2, 4, 6] [1, 3, 5, 7]
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("replicate", "shard", "tp", "dp")


class MeshError(ValueError):
    """Axis sizes whose product is not the world size."""


def check_mesh(world_size: int, dp_outer: int = 1, tp: int = 1) -> None:
    """One message naming every size when `dp_outer x shard x tp` cannot make the world."""
    if dp_outer < 1 or tp < 1 or world_size % (dp_outer * tp):
        raise MeshError(
            f"cluster.num_workers={world_size} is not sharding.dp_outer={dp_outer} x parallel.tp={tp} x a "
            f"whole number of data-parallel shards: the world is replicate x shard x tp ranks, so "
            f"dp_outer x tp ({dp_outer * tp}) must divide num_workers")


@dataclass(frozen=True)
class Topology:
    """A rank's place on the named axes. `rank` is the global rank; `axis_rank(axis)` its index
    in its group along `axis`."""

    world_size: int
    rank: int
    dp_outer: int = 1
    tp: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world size {self.world_size}")
        check_mesh(self.world_size, self.dp_outer, self.tp)

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: the global batch splits across them (a TP group shares one part)."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_shard(self) -> int:
        return self.dp_size // self.dp_outer

    @property
    def shard_rank(self) -> int:
        return self.dp_rank % self.dp_shard

    @property
    def replica_rank(self) -> int:
        return self.dp_rank // self.dp_shard

    def size(self, axis: str) -> int:
        sizes = {"shard": self.dp_shard, "replicate": self.dp_outer, "tp": self.tp, "dp": self.dp_size}
        return sizes[self._known(axis)]

    def axis_rank(self, axis: str) -> int:
        return {"shard": self.shard_rank, "replicate": self.replica_rank, "tp": self.tp_rank,
                "dp": self.dp_rank}[self._known(axis)]

    def groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis` (every rank must create all of them,
        in this order, for torch.distributed)."""
        o, s, t = self.dp_outer, self.dp_shard, self.tp

        def rank(r: int, i: int, j: int) -> int:
            return (r * s + i) * t + j

        if self._known(axis) == "shard":
            return [[rank(r, i, j) for i in range(s)] for r in range(o) for j in range(t)]
        if axis == "replicate":
            return [[rank(r, i, j) for r in range(o)] for i in range(s) for j in range(t)]
        if axis == "tp":
            return [[rank(r, i, j) for j in range(t)] for r in range(o) for i in range(s)]
        return [[d * t + j for d in range(self.dp_size)] for j in range(t)]  # dp

    def my_group(self, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if self.rank in g)

    def describe(self) -> list[str]:
        """The mesh in words: each axis of more than one rank and the global ranks of its groups."""
        lines = [f"mesh: replicate {self.dp_outer} x shard {self.dp_shard} x tp {self.tp} = {self.world_size} ranks"]
        for axis in AXES:
            same = axis == "dp" and (self.dp_outer == 1 or self.tp == 1)  # = shard, or = replicate x shard
            if self.size(axis) > 1 and not same:
                groups = " ".join("[" + ", ".join(map(str, g)) + "]" for g in self.groups(axis))
                lines.append(f"  {axis:<9} groups {groups}")
        return lines

    @staticmethod
    def _known(axis: str) -> str:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; axes are {AXES}")
        return axis
