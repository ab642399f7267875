"""Who talks to whom: pure arithmetic from world size and rank to named axes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """A rank's place on the data-parallel axis.

    `rank` is the global rank; `dp_rank` the rank among the data-parallel peers it shards
    with. With one replica group (all strategies so far) the dp group is the whole world.
    """

    world_size: int
    rank: int

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world size {self.world_size}")

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    def dp_groups(self) -> list[list[int]]:
        """The global ranks of every data-parallel group."""
        return [list(range(self.world_size))]
