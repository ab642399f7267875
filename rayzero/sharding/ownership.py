"""Who owns the optimizer state: the ownership column of the table in strategies.py.

    OwnAll                   DDP: every rank steps AdamW on everything
    OwnShard                 ZeRO-1/2/3: each rank steps its shard of every bucket, then the
                             updated shards are all-gathered where parameters are whole at rest
    OwnShardAcrossReplicas   Hybrid-FSDP (`dp_outer` > 1, `outer_strategy=optim`): the replicas
                             split that shard again; the strategy picks it in place of OwnShard

Each has a start/finish pair around the all-gather of updated parameters: `start()` after the
step, `finish(buckets)` before they are read (the next forward waits per bucket where
`overlap_param_gather` lets it). And each says what happens across the replicas of hybrid
sharding at the end of gradient sync (`reduce_outer`): a rank must end with the sum over every
data-parallel rank of the gradients it owns.

An ownership acts on one bucket group (group.py) and is handed the group's placement (whether
parameters are whole at rest, and its views of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.distributed as dist

from rayzero.sharding.comm import Axis, wait
from rayzero.sharding.first_reads import FirstReads
from rayzero.sharding.layout import Bucket, Range

if TYPE_CHECKING:
    from rayzero.sharding.group import BucketGroup


def _wait_all(works: list[dist.Work | None]) -> None:
    for work in works:
        wait(work)


class OwnAll:
    """DDP: every rank owns every element; the updated parameters are already whole."""

    axis: Axis | None = None  # owned ranges tile the buffer on every rank: nothing to sum across
    in_forward = False

    def __init__(self, g: BucketGroup, placement, model: nn.Module):
        self.g = g

    def owned(self, b: Bucket) -> Range:
        return b.world

    @property
    def saves_shard(self) -> bool:
        return self.g.reduce.rank == 0  # the other ranks hold the same copy

    def reduce_outer(self, grads: list[torch.Tensor]) -> None:
        """No replicas: DDP is never hybrid."""

    def start(self) -> None:
        """Nothing to gather."""

    def finish(self, buckets: list[int] | None = None) -> None:
        """Nothing to wait for."""


class OwnShard:
    """Each rank owns its shard of every bucket (the part its shard group assigns it). HSDP
    replicas own the same shards: their gradients are all-reduced across the replicas."""

    def __init__(self, g: BucketGroup, placement, model: nn.Module):
        self.g, self.placement, self.model = g, placement, model
        self._work: dict[int, dist.Work | None] = {}  # bucket -> its pending all-gather
        # Forward waits bucket by bucket for the all-gather instead of all at once before it.
        self.in_forward = g.overlap_param_gather and placement.whole_at_rest
        self.reads: FirstReads | None = None  # the watch for reads without their module's forward
        self._hook()

    @property
    def axis(self) -> Axis:
        """The ranks across which owned ranges tile the group exactly once (grad norm, export)."""
        return self.g.axis

    def owned(self, b: Bucket) -> Range:
        return self.g.inner(b)

    @property
    def saves_shard(self) -> bool:
        return self.g.outer.rank == 0  # other replicas hold the same shards

    def _hook(self) -> None:
        """With `in_forward`, each module's forward first waits for its buckets' all-gather; a
        module inside a compiled block (`train.compile`: the block marked `compiled_block`) waits
        at the block's entry instead, outside the compiled code, for all of the block's buckets
        (a wait inside it would split the block's graph at every layer). Without compiled blocks,
        the first forward after a gather is watched for parameters read without their module's
        forward (`FirstReads`)."""
        if not self.in_forward:
            return
        bucket_of = self.read_buckets()  # (frozen buckets are never gathered: nothing to wait for)
        holder: dict[nn.Module, nn.Module] = {}  # a module -> the module whose forward waits for its buckets
        for block in (m for m in self.model.modules() if getattr(m, "compiled_block", False)):
            holder.update({inner: block for inner in block.modules()})
        waits: dict[nn.Module, set[int]] = {}
        for module in self.model.modules():
            own = {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
            if own:
                waits.setdefault(holder.get(module, module), set()).update(own)
        for at, own in waits.items():
            at.register_forward_pre_hook(self._wait_for(sorted(own)))
        if not holder:  # (a compiled block waits for every bucket under it at its entry)
            self.reads = FirstReads(self.model, self)

    # -- what the watch of first reads asks (FirstReads)
    def read_buckets(self) -> dict[int, int]:
        """This group's trainable parameters' buckets, by the `id` of the parameters now."""
        buffer, mine = self.g.buffer, {b.index for b in self.g.trainable}
        return {id(p): b for i, p in enumerate(buffer.params) if (b := buffer.bucket_of(i)) in mine}

    def in_flight(self, bucket: int) -> bool:
        return bucket in self._work

    def wait_before(self, module: nn.Module, buckets: list[int]) -> None:
        module.register_forward_pre_hook(self._wait_for(buckets))

    def _wait_for(self, buckets: list[int]):
        def hook(_module, _args) -> None:
            self.finish(buckets)

        return hook

    def reduce_outer(self, grads: list[torch.Tensor]) -> None:
        axis = self.g.outer
        if axis.size > 1:
            _wait_all([axis.start_all_reduce(t) for t in grads])

    def start(self) -> None:
        g = self.g
        if g.axis.size == 1 or not self.placement.whole_at_rest:
            return
        # Forward order: the buffer holds parameters last layer first, so the last bucket is
        # the one the next forward needs first. In place: each rank's shard already sits at
        # its place in the bucket (NCCL and gloo both accept that aliasing).
        for b in reversed(g.trainable):  # frozen buckets never change
            full = g.buffer.data[b.index]
            self._work[b.index] = g.axis.start_all_gather(full, g.axis.chunk(full))
        if self.reads is not None:
            self.reads.arm()

    def finish(self, buckets: list[int] | None = None) -> None:
        for i in list(self._work) if buckets is None else buckets:
            if i in self._work:
                wait(self._work.pop(i))
        if buckets is None and self.reads is not None:
            self.reads.gathered()


class OwnShardAcrossReplicas:
    """Hybrid-FSDP: the replicas split each rank's shard again, so a rank owns 1/dp_outer of it.
    Gradients are reduce-scattered across the replicas; after the step the replicas' pieces are
    all-gathered into the shard, which is then made whole as OwnShard makes it."""

    saves_shard = True  # every rank owns a distinct piece

    def __init__(self, g: BucketGroup, placement, model: nn.Module):
        self.g, self.placement = g, placement
        self.within = OwnShard(g, placement, model)  # the shard group's part, as without replicas
        self.in_forward = self.within.in_forward

    @property
    def axis(self) -> Axis:
        return self.g.reduce

    def owned(self, b: Bucket) -> Range:
        inner = self.g.inner(b)
        n = inner.size // self.g.outer.size
        start = inner.start + self.g.outer.rank * n
        return Range(start, start + n)

    def reduce_outer(self, grads: list[torch.Tensor]) -> None:
        axis = self.g.outer
        _wait_all([axis.start_reduce_scatter(t) for t in grads])

    def start(self) -> None:
        g, view = self.g, self.placement.view
        _wait_all([g.outer.start_all_gather(view(b, g.inner(b)), view(b, self.owned(b)).clone())
                   for b in g.trainable])
        self.within.start()

    def finish(self, buckets: list[int] | None = None) -> None:
        self.within.finish(buckets)
