"""The mesh: the world as a grid of named axes, and the one object every part asks about it.

A `Mesh` holds the axis sizes, this rank's coordinate on each axis and (on a rank, once
`connect` has run) the process group of each axis. The config's checks, the driver's plan,
the layout, the strategies, tensor parallelism and checkpoints all read it; nothing else
works out a size, a coordinate or a group. An elastic resize builds a new mesh.

The axes, outermost first (`ORDER`); their product is the world size:

    axis        size                             what runs over it
    pp          parallel.pp                      pipeline stages: outermost, so a stage is a run of
                                                 consecutive ranks (its TP groups on its nodes) and
                                                 consecutive stages sit on neighbouring nodes
    replicate   sharding.dp_outer                hybrid sharding's outer reduction (HSDP / Hybrid-FSDP)
    shard       what the others leave            ZeRO sharding inside a replica
    tp          parallel.tp                      tensor parallelism: innermost, so a TP group is a
                                                 run of consecutive ranks (one node's GPUs)

and the flattened axes (`FLAT`), groups over several of them:

    dp          replicate x shard                the batch splits over it (a TP group shares one part)
    stage       replicate x shard x tp           one pipeline stage's ranks (its norms and sums)
    world       every axis                       the global norm's and the loss's sums

A rank's global number is its coordinates read row-major, outermost first:

    world 8, pp 2, tp 2:   rank = (pp * 2 + shard) * 2 + tp
        rank       0  1  2  3  4  5  6  7
        pp         0  0  0  0  1  1  1  1
        shard      0  0  1  1  0  0  1  1
        tp         0  1  0  1  0  1  0  1
        pp groups         [0, 4] [1, 5] [2, 6] [3, 7]     (a stage's neighbours: the sends)
        shard groups      [0, 2] [1, 3] [4, 6] [5, 7]     (= dp: each stage shards on its own)
        tp groups         [0, 1] [2, 3] [4, 5] [6, 7]

    world 8, dp_outer 2, tp 2:   rank = (replicate * 2 + shard) * 2 + tp
        replicate groups  [0, 4] [1, 5] [2, 6] [3, 7]
        dp groups         [0, 2, 4, 6] [1, 3, 5, 7]

Adding an axis is a change here and in the code that uses it, nowhere else: the coordinates,
the groups, their creation on every rank, the divisibility check and its message, `describe`
and the plan all follow from `ORDER`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where groups are made: reading a config builds a mesh
    from rayzero.sharding.comm import Axis

ORDER = ("pp", "replicate", "shard", "tp")  # outermost first
FILLS = "shard"  # the axis whose size is what the others leave of the world
FLAT = {"dp": ("replicate", "shard"), "stage": ("replicate", "shard", "tp"), "world": ORDER}  # groups over several axes
KEYS = {"pp": "parallel.pp", "replicate": "sharding.dp_outer", "tp": "parallel.tp"}  # the config key that sets each set axis


class MeshError(ValueError):
    """Axis sizes whose product cannot make the world."""


def _set_sizes_error(world_size: int, sizes: dict[str, int]) -> str | None:
    """The one divisibility rule, in words (None: the set sizes divide the world)."""
    bad = [a for a, n in sizes.items() if n < 1]
    if bad:
        return f"{KEYS[bad[0]]}: {sizes[bad[0]]} must be at least 1"
    product = math.prod(sizes.values())
    if world_size >= 1 and world_size % product == 0:
        return None
    named = [a for a in sizes if sizes[a] > 1]
    what = (f"{KEYS[named[0]]}: {sizes[named[0]]}" if len(named) == 1 else
            " x ".join(KEYS[a] for a in named) + ": " + " x ".join(str(sizes[a]) for a in named) + f" = {product}")
    key = {a: KEYS[a].rpartition(".")[2] for a in KEYS}
    groups = " x ".join(f"{a} ({key[a]})" if key.get(a, a) != a else a for a in ORDER)
    return f"{what} does not divide cluster.num_workers ({world_size}): the ranks form {groups} groups"


def fits(world_size: int, **sizes: int) -> bool:
    """Whether a world of `world_size` ranks makes a mesh with these set axis sizes."""
    return _set_sizes_error(world_size, {a: sizes.get(a, 1) for a in KEYS}) is None


@dataclass(frozen=True)
class Mesh:
    """A rank's place on the named axes: `size(axis)`, `coord(axis)` (its index in its group
    along the axis) and, on a connected rank, `axis(name)` (the group and its collectives).
    The driver builds one for rank 0 with no groups, for its checks and plans."""

    world_size: int
    rank: int = 0
    replicate: int = 1  # the size of each axis in KEYS (`shard` fills the rest)
    tp: int = 1
    pp: int = 1
    groups_by_axis: dict[str, Axis] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        error = _set_sizes_error(self.world_size, self._set_sizes)
        if error:
            raise MeshError(error)
        if not 0 <= self.rank < self.world_size:
            raise MeshError(f"rank {self.rank} out of range for world size {self.world_size}")

    # -- sizes and coordinates -------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """Each axis's size, outermost first."""
        set_sizes = self._set_sizes
        rest = self.world_size // math.prod(set_sizes.values())
        return {a: set_sizes.get(a, rest) for a in ORDER}

    def size(self, axis: str) -> int:
        shape = self.shape
        return math.prod(shape[a] for a in self._parts(axis))

    def coord(self, axis: str) -> int:
        """This rank's index in its group along `axis` (a flat axis: row-major over its parts)."""
        coords = self.coords(self.rank)
        index = 0
        for a in self._parts(axis):
            index = index * self.shape[a] + coords[a]
        return index

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate on each axis."""
        out, rest = {}, rank
        for a, n in reversed(self.shape.items()):
            out[a], rest = rest % n, rest // n
        return dict(reversed(out.items()))

    def rank_at(self, coords: dict[str, int]) -> int:
        rank = 0
        for a, n in self.shape.items():
            rank = rank * n + coords[a]
        return rank

    # -- groups ----------------------------------------------------------------------------
    def groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis`, in the order every rank creates them
        (torch.distributed asks all ranks to create every group, in the same order)."""
        parts = self._parts(axis)
        shape = self.shape
        others = [a for a in ORDER if a not in parts]
        out = []
        for fixed in itertools.product(*(range(shape[a]) for a in others)):
            out.append([self.rank_at({**dict(zip(others, fixed)), **dict(zip(parts, along))})
                        for along in itertools.product(*(range(shape[a]) for a in parts))])
        return out

    def my_group(self, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if self.rank in g)

    def axis(self, name: str) -> Axis:
        """The group along `name` and its collectives; on the driver (not connected), the
        axis's shape only, whose collectives must not be called."""
        from rayzero.sharding.comm import Axis

        return self.groups_by_axis.get(name) or Axis(None, self.size(name), self.coord(name))

    def connect(self) -> "Mesh":
        """This mesh with a process group for every axis (after `init_process_group`): an axis
        of one rank has none, one that spans the world is the world's, one whose groups are
        another's shares them. Every rank creates every other group, in the same order."""
        import torch.distributed as dist

        from rayzero.sharding.comm import Axis

        made: dict[str, Axis] = {}
        by_ranks: dict[tuple, Axis] = {}
        for name in (*ORDER, *FLAT):
            size = self.size(name)
            mine = tuple(self.my_group(name))
            if size == 1:
                made[name] = Axis(None, 1, 0)
            elif size == self.world_size:
                made[name] = by_ranks.setdefault(mine, Axis(dist.group.WORLD, size, self.coord(name)))
            elif mine in by_ranks:
                made[name] = by_ranks[mine]
            else:
                for ranks in self.groups(name):
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        made[name] = by_ranks[mine] = Axis(group, size, self.coord(name))
        return Mesh(self.world_size, self.rank, **self._set_sizes, groups_by_axis=made)

    # -- in words --------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """The mesh in words: each axis of more than one rank and the global ranks of its groups
        (a flat axis only where its groups are not one axis's or the whole world)."""
        shape = self.shape
        shown = {a: n for a, n in shape.items() if a != "pp" or n > 1}  # no pipeline: as before there was one
        lines = ["mesh: " + " x ".join(f"{a} {n}" for a, n in shown.items()) + f" = {self.world_size} ranks"]
        for name in (*ORDER, *FLAT):
            size = self.size(name)
            same = name in FLAT and (size == self.world_size or size in (shape[a] for a in FLAT[name]))
            if size > 1 and not same:
                groups = " ".join("[" + ", ".join(map(str, g)) + "]" for g in self.groups(name))
                lines.append(f"  {name:<9} groups {groups}")
        return lines

    @property
    def _set_sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in KEYS}

    @staticmethod
    def _parts(axis: str) -> tuple[str, ...]:
        if axis in ORDER:
            return (axis,)
        if axis in FLAT:
            return FLAT[axis]
        raise ValueError(f"unknown axis {axis!r}; axes are {ORDER + tuple(FLAT)}")
