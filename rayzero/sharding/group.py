"""A bucket group: the buckets whose gradients are reduced over the same ranks, and what the
policies of the strategy table act on (Megatron's per-(dtype, is-expert) buffers with their own
data-parallel group).

The layout emits buckets keyed by (dtype, dense or expert): no bucket mixes the two kinds, and
each kind is one group. A group carries its own axes, which the mesh's roles give:

    group     shard (ZeRO's shards)   outer (hybrid replicas)   reduce (every gradient summed)
    dense     grad_shard              grad_replicate            grad_reduce
    expert    expert_shard            expert_replicate          expert_dp

and its precision, its memory ledger, the overlap switches, and, once the strategy has built
them, its buckets' gradient storage (`grads`, indexed by bucket like the buffer's). A policy is
built for one group and reads only it, and the policy it needs, handed to it (the ZeRO-3
placement the gradient landing, the ownership the placement), never the strategy.

Where the next axes plug in:
- context parallelism joins `cp` to the dense roles (every rank of a cp group holds the same
  weights, so gradients are reduced and sharded over dp x cp): the groups take the wider axes
  from the mesh, nothing here changes;
- expert parallelism splits `expert_shard` / `expert_dp` by `ep`: the expert group's buckets are
  then reduced and sharded over the ranks holding the same experts, while the dense group's
  still span every data-parallel rank. Today the expert roles name the same ranks as the dense
  ones, and a model's experts form a group only where the caller names them (`experts`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rayzero.sharding.layout import Bucket, Range

if TYPE_CHECKING:
    from rayzero.sharding.comm import Axis
    from rayzero.sharding.flat_buffer import FlatBuffer
    from rayzero.sharding.memory import MemoryLedger
    from rayzero.sharding.precision import Precision


@dataclass(frozen=True)
class GroupKey:
    """What groups buckets: the compute dtype, and whether they hold a model's experts."""

    dtype: torch.dtype
    expert: bool

    @property
    def name(self) -> str:
        return ("expert" if self.expert else "dense") + "/" + str(self.dtype).removeprefix("torch.")


# The mesh's roles for each kind of group: (shard, outer, reduce).
ROLES = {False: ("grad_shard", "grad_replicate", "grad_reduce"),
         True: ("expert_shard", "expert_replicate", "expert_dp")}


@dataclass
class BucketGroup:
    """Buckets reduced and sharded over one set of ranks, and what a policy needs of them."""

    key: GroupKey
    buffer: FlatBuffer
    buckets: tuple[Bucket, ...]  # this group's buckets, in buffer order (buffer indices)
    axis: Axis  # the ranks that shard the group: each holds its part of every bucket
    outer: Axis  # hybrid sharding's replicas of a shard (size 1 without)
    reduce: Axis  # every rank whose gradients are summed: axis x outer
    precision: Precision
    ledger: MemoryLedger
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket index -> its gradient storage

    def inner(self, b: Bucket) -> Range:
        """The part of `b` this rank's shard axis assigns to it (world coordinates)."""
        return b.shard(self.axis.rank, self.axis.size)

    @functools.cached_property
    def trainable(self) -> list[Bucket]:
        """The buckets whose parameters train (fixed once the model is built)."""
        return [b for b in self.buckets if self.buffer.trainable(b)]

