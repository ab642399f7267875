"""DDP, ZeRO-1 and ZeRO-2: one class each, each stage a subclass of the one before it.

See strategies.py for the phases they are driven through and fsdp.py for ZeRO-3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rayzero.sharding.comm import Axis, wait
from rayzero.sharding.layout import Bucket, Range
from rayzero.sharding.strategies import Strategy, _bytes


class NoShard(Strategy):
    """DDP: all-reduce gradients, every rank runs the full optimizer."""

    name = "no_shard"


class ShardOptim(Strategy):
    """ZeRO-1: reduce-scatter gradients, AdamW on the rank's shard, all-gather parameters."""

    name = "optim"

    def __init__(self, *args, **kwargs):
        self._param_work: dict[int, dist.Work | None] = {}
        super().__init__(*args, **kwargs)
        self._param_sync_in_forward = self.cfg.overlap_param_gather and self._full_params_at_rest
        if self._param_sync_in_forward:
            bucket_of = {id(p): self.buffer.bucket_of(i) for i, p in enumerate(self.buffer.params)}
            for module in self.model.modules():
                own = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False)})
                if own:
                    module.register_forward_pre_hook(self._wait_for(own))

    def _wait_for(self, buckets: list[int]):
        def hook(_module, _args) -> None:
            self.finish_param_sync(buckets)

        return hook

    @property
    def _hybrid_optim(self) -> bool:
        return self.replicate_axis.size > 1 and self.cfg.outer_strategy == "optim"

    def _owned_range(self, b: Bucket) -> Range:
        inner = self.inner(b)
        if not self._hybrid_optim:
            return inner
        n = inner.size // self.replicate_axis.size
        start = inner.start + self.replicate_axis.rank * n
        return Range(start, start + n)

    @property
    def owner_axis(self) -> Axis:
        return self.mesh.axis("dp") if self._hybrid_optim else self.shard_axis

    def _launch_reduce(self, b):
        grad = self.grads[b.index]
        comm = self._to_comm(grad)
        work = self.shard_axis.start_reduce_scatter(comm)

        def finish():
            if comm is not grad:
                grad[self._local(self.inner(b), b)].copy_(self.shard_axis.chunk(comm))
            self._free_comm(comm, grad)

        return work, finish

    def _inner_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient shard of `b` (what the outer reduction works on)."""
        return self.grads[b.index][self._local(self.inner(b), b)]

    def _outer_reduce(self) -> None:
        axis = self.replicate_axis
        if axis.size == 1:
            return
        start = axis.start_reduce_scatter if self._hybrid_optim else axis.start_all_reduce
        for work in [start(self._inner_grad(b)) for b in self._trainable_buckets()]:
            wait(work)

    def _start_param_sync(self) -> None:
        if self._hybrid_optim:  # the replicas' pieces first make this rank's inner shard whole
            works = [self.replicate_axis.start_all_gather(self._param_view(b, self.inner(b)),
                                                          self._param_view(b, self.owned(b)).clone())
                     for b in self._trainable_buckets()]
            for work in works:
                wait(work)
        if self.shard_axis.size == 1 or not self._full_params_at_rest:
            return
        # Forward order: the buffer holds parameters last layer first, so the last bucket is
        # the one the next forward needs first. In place: each rank's shard already sits at
        # its place in the bucket (NCCL and gloo both accept that aliasing).
        for b in reversed(self._trainable_buckets()):  # frozen buckets never change
            full = self.buffer.data[b.index]
            self._param_work[b.index] = self.shard_axis.start_all_gather(full, self.shard_axis.chunk(full))

    def finish_param_sync(self, buckets: list[int] | None = None) -> None:
        for i in list(self._param_work) if buckets is None else buckets:
            if i in self._param_work:
                wait(self._param_work.pop(i))


class ShardOptimGrads(ShardOptim):
    """ZeRO-2: every micro-batch, each bucket is reduce-scattered as soon as its gradients are
    complete and added into this rank's gradient shard; the full bucket is then freed."""

    name = "optim_grads"
    reduce_every_microbatch = True

    def __init__(self, *args, **kwargs):
        self._landing: dict[int, torch.Tensor] = {}
        super().__init__(*args, **kwargs)

    def _add_grads(self, b):
        grad = torch.zeros(self.inner(b).size, dtype=self.precision.grad, device=self.buffer.device)
        self.ledger.hold("grads", _bytes(grad))
        self.grads.append(grad)
        own = self.owned(b).shift(-self.inner(b).start)
        self.main_grads.append(grad[own.slice()])

    def _grad_is_view(self, i):
        return False

    def _grad_landing(self, b):
        if b.index not in self._landing:
            full = torch.zeros(b.world.size, dtype=self.precision.grad, device=self.buffer.device)
            self.ledger.grow(_bytes(full))
            self._landing[b.index] = full
        return self._landing[b.index]

    def _start_reduce(self, b):
        if b.index not in self._reduced:
            # Bound the transient memory: one bucket in flight besides the one filling.
            for index in list(self._inflight):
                self._finish_reduce(index)
        super()._start_reduce(b)

    def _launch_reduce(self, b):
        full = self._grad_landing(b)
        for i in b.params:  # no view of the landing outlives it (a parameter that got no gradient)
            self.buffer.params[i].grad = None
        comm = self._to_comm(full)
        work = self.shard_axis.start_reduce_scatter(comm)

        def finish():
            self.grads[b.index].add_(self.shard_axis.chunk(comm))
            self._free_comm(comm, full)
            self.ledger.shrink(_bytes(self._landing.pop(b.index)))

        return work, finish

    def _inner_grad(self, b):
        return self.grads[b.index]
