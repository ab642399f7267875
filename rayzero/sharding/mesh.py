"""The mesh: the world as a grid of named axes, and the one object every part asks about it.

A `Mesh` holds the axis sizes, this rank's coordinate on each axis and (on a rank, once
`connect` has run) the process group of each axis. The config's checks, the driver's plan,
the layout, the strategies, tensor parallelism and checkpoints all read it; nothing else
works out a size, a coordinate or a group. An elastic resize builds a new mesh.

The axes, outermost first (`AXES`: each with the config key that sets its size); their product
is the world size:

    axis        size                             what it splits
    pp          parallel.pp                      the model's layers into pipeline stages: outermost,
                                                 so a stage is a run of consecutive ranks (its TP
                                                 groups on its nodes) and consecutive stages sit
                                                 on neighbouring nodes
    replicate   sharding.dp_outer                the data-parallel ranks into replicas (HSDP /
                                                 Hybrid-FSDP's outer reduction)
    shard       what the others leave            a replica's data-parallel ranks (ZeRO's shards)
    ep          parallel.ep                      a mixture of experts' experts (expert parallelism):
                                                 data-parallel ranks for everything else (they take
                                                 different rows, and the dense parameters shard
                                                 over them), each holding E/ep of every layer's
                                                 experts, the tokens sent to their experts
    cp          parallel.cp                      each sequence (context parallelism): the ranks of a
                                                 cp group take the same rows, each its part of
                                                 every sequence, and hold the same weights
    tp          parallel.tp                      each layer's matrices: innermost, so a TP group is
                                                 a run of consecutive ranks (one node's GPUs)

Code outside this module asks for a **role** (`ROLES`), never an axis: what a group is for, so
that a new axis changes the roles' table, not the code that uses them:

    role            axes                          what runs over it
    batch           replicate x shard x ep        the global batch splits over it (a TP group, a
                                                  cp group and a pipeline's stages share one part)
    loss            replicate x shard x ep x cp   the valid-token counts and the losses are summed
    grad_reduce     replicate x shard x ep x cp   every dense gradient is reduced; the buffer is
                                                  padded to its size
    grad_shard      shard x ep x cp               ZeRO shards gradients, optimizer state and
                                                  parameters (inside a replica)
    grad_replicate  replicate                     hybrid sharding's outer reduction
    expert_dp       replicate x shard x cp        ranks holding the same experts: the expert
                                                  bucket group's gradients are reduced over it
    expert_shard    shard x cp                    ZeRO shards the expert group over it
    expert_replicate replicate                    the expert group's hybrid replicas
    ep              ep                            expert parallelism's all-to-alls; the experts
                                                  split over it
    cp              cp                            context parallelism's ring or all-to-all
    tp              tp                            tensor parallelism's collectives
    pp              pp                            a pipeline's sends, stage to stage
    node            tp                            ranks placed on one node (TP's collectives need
                                                  its links): the placement keeps each group together
    stage           replicate x shard x ep x cp x tp  one pipeline stage's ranks (its norms and sums)
    world           every axis                    the global norm's and the loss's sums

Context parallelism's `cp` axis sits between `shard` and `tp` (Megatron's order: tp innermost,
then cp, then the data-parallel axes, then pp) and joins `loss`, `grad_reduce` and `grad_shard`:
the sequence splits over it and every rank of a cp group holds the same weights, so gradients
are reduced and sharded over data-parallel x cp, while `batch` leaves it out. Expert
parallelism's `ep` axis is folded into the data-parallel ranks, as Megatron folds it: for the
dense parameters and the data it is one more data-parallel axis (in `batch`, `loss`,
`grad_reduce`, `grad_shard`), while the expert roles leave it out, so the experts' bucket group
reduces and shards over the ranks that hold the same experts. The code asking for those roles
does not change: the strategy's bucket groups (group.py) take their axes from them.

A rank's global number is its coordinates read row-major, outermost first:

    world 8, pp 2, tp 2:   rank = (pp * 2 + shard) * 2 + tp
        rank       0  1  2  3  4  5  6  7
        pp         0  0  0  0  1  1  1  1
        shard      0  0  1  1  0  0  1  1
        tp         0  1  0  1  0  1  0  1
        pp groups         [0, 4] [1, 5] [2, 6] [3, 7]     (a stage's neighbours: the sends)
        shard groups      [0, 2] [1, 3] [4, 6] [5, 7]     (= batch: each stage shards on its own)
        tp groups         [0, 1] [2, 3] [4, 5] [6, 7]

    world 8, dp_outer 2, tp 2:   rank = (replicate * 2 + shard) * 2 + tp
        replicate groups  [0, 4] [1, 5] [2, 6] [3, 7]
        batch groups      [0, 2, 4, 6] [1, 3, 5, 7]

Adding an axis is a row of `AXES`, its roles in `ROLES`, and the code of what it splits; the
coordinates, the groups, their creation on every rank, the divisibility check and its
message (`validate`), `describe` and the plan follow from the tables.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where groups are made: reading a config builds a mesh
    from rayzero.sharding.comm import Axis


# Each axis, outermost first, and the config key that sets its size (None: it takes what the others leave).
AXES: dict[str, str | None] = {"pp": "parallel.pp", "replicate": "sharding.dp_outer", "shard": None,
                               "ep": "parallel.ep", "cp": "parallel.cp", "tp": "parallel.tp"}
ORDER = tuple(AXES)
KEYS = {a: key for a, key in AXES.items() if key}  # the axes a config key sets
ROLES: dict[str, tuple[str, ...]] = {
    "batch": ("replicate", "shard", "ep"),
    "loss": ("replicate", "shard", "ep", "cp"),
    "grad_reduce": ("replicate", "shard", "ep", "cp"),
    "grad_shard": ("shard", "ep", "cp"),
    "grad_replicate": ("replicate",),
    "expert_dp": ("replicate", "shard", "cp"),
    "expert_shard": ("shard", "cp"),
    "expert_replicate": ("replicate",),
    "ep": ("ep",),
    "cp": ("cp",),
    "tp": ("tp",),
    "pp": ("pp",),
    "node": ("tp",),
    "stage": ("replicate", "shard", "ep", "cp", "tp"),
    "world": ORDER,
}


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
    """A rank's place on the named axes, asked for by role (`ROLES`): `size(role)`,
    `coord(role)` (its index in its group) and, on a connected rank, `axis(role)` (the group
    and its collectives). The driver builds one for rank 0 with no groups, for its checks and
    plans. (Inside this module an axis's name is taken too.)"""

    world_size: int
    rank: int = 0
    replicate: int = 1  # the size of each axis in KEYS (`shard` fills the rest)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    groups_by_role: dict[str, Axis] = field(default_factory=dict, compare=False, repr=False)

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

    def size(self, role: str) -> int:
        shape = self.shape
        return math.prod(shape[a] for a in self._parts(role))

    def coord(self, role: str) -> int:
        """This rank's index in its group of `role` (row-major over the role's axes)."""
        coords = self.coords(self.rank)
        index = 0
        for a in self._parts(role):
            index = index * self.shape[a] + coords[a]
        return index

    def validate(self, cfg) -> None:
        """The checks the axes put on the run's shapes (`cfg`: its config), each a ValueError
        naming the key to change; the config's own validation runs them, so `--dry-run`, the
        driver and every rank refuse the same run in the same words."""
        t, tp, cp = cfg.train, self.size("tp"), self.size("cp")
        if cp > 1 and t.seq_len % (2 * cp):
            fit = [n for n in range(t.seq_len - 2 * cp, t.seq_len + 4 * cp + 1) if n > 0 and n % (2 * cp) == 0][:3]
            raise ValueError(f"train.seq_len: {t.seq_len} does not split into 2 x parallel.cp = {2 * cp} equal chunks "
                             f"(each cp rank holds two, for even causal work); e.g. {', '.join(map(str, fit))} would")
        if cfg.parallel.sequence_parallel and (t.seq_len // cp) % tp:
            raise ValueError(f"train.seq_len: {t.seq_len} is not divisible by parallel.tp ({tp})"
                             + (f" x parallel.cp ({cp})" if cp > 1 else "")
                             + ", over which parallel.sequence_parallel splits the sequence")
        batch = self.size("batch")
        if t.global_batch_size % (t.micro_batch_size * batch):
            raise ValueError(
                f"train.global_batch_size: {t.global_batch_size} is not divisible by "
                f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({batch}) "
                f"= {t.micro_batch_size * batch}"
            )

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
    def groups(self, role: str) -> list[list[int]]:
        """The global ranks of every group of `role`, in the order every rank creates them
        (torch.distributed asks all ranks to create every group, in the same order)."""
        parts = self._parts(role)
        shape = self.shape
        others = [a for a in ORDER if a not in parts]
        out = []
        for fixed in itertools.product(*(range(shape[a]) for a in others)):
            out.append([self.rank_at({**dict(zip(others, fixed)), **dict(zip(parts, along))})
                        for along in itertools.product(*(range(shape[a]) for a in parts))])
        return out

    def my_group(self, role: str) -> list[int]:
        return next(g for g in self.groups(role) if self.rank in g)

    def axis(self, role: str) -> Axis:
        """The group of `role` and its collectives; on the driver (not connected), its shape
        only, whose collectives must not be called."""
        from rayzero.sharding.comm import Axis

        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        return self.groups_by_role.get(role) or Axis(None, self.size(role), self.coord(role))

    def connect(self) -> "Mesh":
        """This mesh with a process group for every role (after `init_process_group`): a role
        of one rank has none, one that spans the world is the world's, one whose groups are
        another's shares them. Every rank creates every other group, in the same order."""
        import torch.distributed as dist

        from rayzero.sharding.comm import Axis

        made: dict[str, Axis] = {}
        by_ranks: dict[tuple, Axis] = {}
        for name in ROLES:
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
        return Mesh(self.world_size, self.rank, **self._set_sizes, groups_by_role=made)

    # -- in words --------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """The mesh in words: each axis of more than one rank and the global ranks of its groups,
        then the roles over several axes whose groups are no axis's and not the whole world
        (the roles with the same groups on one line)."""
        shape = self.shape
        shown = {a: n for a, n in shape.items() if a not in ("pp", "ep", "cp") or n > 1}  # as before there were these
        lines = ["mesh: " + " x ".join(f"{a} {n}" for a, n in shown.items()) + f" = {self.world_size} ranks"]
        for name in ORDER:
            if shape[name] > 1:
                lines.append(f"  {name:<9} groups {self._in_words(name)}")
        by_groups: dict[str, list[str]] = {}
        for name, axes in ROLES.items():
            size = self.size(name)
            if len(axes) > 1 and size > 1 and size != self.world_size and size not in (shape[a] for a in axes):
                by_groups.setdefault(self._in_words(name), []).append(name)
        for groups, names in by_groups.items():
            lines.append(f"  {', '.join(names):<9} groups {groups}")
        return lines

    def _in_words(self, name: str) -> str:
        return " ".join("[" + ", ".join(map(str, g)) + "]" for g in self.groups(name))

    @property
    def _set_sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in KEYS}

    @staticmethod
    def _parts(name: str) -> tuple[str, ...]:
        if name in ROLES:
            return ROLES[name]
        if name in AXES:
            return (name,)
        raise ValueError(f"unknown role {name!r}; roles are {', '.join(ROLES)}")
