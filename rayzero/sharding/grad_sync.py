"""How gradients are synchronized across the shard group: the gradient column of the table in
strategies.py.

    AllReduceAtEnd          DDP: full gradient buckets, each all-reduced once per step
    ReduceScatterAtEnd      ZeRO-1: the same buckets, each reduce-scattered once per step
    ReduceScatterPerBucket  ZeRO-2/3: each bucket reduce-scattered on every micro-batch as soon
                            as backward fills it; only this rank's shard of the sums is kept

Each is a start/finish pair around a bucket's collective: `start(bucket)` launches it (once
per backward), `finish()` waits for all in flight and puts their sums in place. At the end
of a step the strategy starts what backward did not and finishes everything; the outer
(hybrid) reduction across the replicas then works on `inner_grad(bucket)`, this rank's
reduced shard of each bucket.

A policy acts on one bucket group (group.py): its buckets, its axis, its gradient storage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from rayzero.sharding.comm import wait
from rayzero.sharding.layout import Bucket, Range
from rayzero.sharding.memory import nbytes

if TYPE_CHECKING:
    from rayzero.sharding.group import BucketGroup


class InFlight:
    """Bucket collectives started and not yet waited for, each with what runs after its wait."""

    def __init__(self):
        self._works: dict[int, tuple[dist.Work | None, Callable[[], None]]] = {}

    def add(self, index: int, work: dist.Work | None, then: Callable[[], None]) -> None:
        self._works[index] = (work, then)

    def finish(self) -> None:
        for index in sorted(self._works):
            work, then = self._works.pop(index)
            wait(work)
            then()


def to_comm(g: BucketGroup, t: torch.Tensor) -> torch.Tensor:
    """`t` in the communication dtype: a transient copy when that differs."""
    if t.dtype == g.precision.comm or g.axis.size == 1:
        return t
    c = t.to(g.precision.comm)
    g.ledger.grow(nbytes(c))
    return c


def free_comm(g: BucketGroup, comm: torch.Tensor, t: torch.Tensor) -> None:
    if comm is not t:
        g.ledger.shrink(nbytes(comm))


def accumulate(g: BucketGroup, landing: torch.Tensor, i: int, param: nn.Parameter) -> None:
    """Add parameter `i`'s gradient into its place in `landing` (a full bucket) and drop it."""
    into = landing[g.buffer.spans[i]]
    if param.grad.data_ptr() != into.data_ptr():  # else autograd accumulated in place
        into.add_(param.grad.view(-1))
    param.grad = None


class AllReduceAtEnd:
    """DDP: a full gradient bucket per bucket of parameters, which every micro-batch's backward
    accumulates into (in place, through the parameters' `.grad` views, where gradients share
    the parameters' dtype); each bucket all-reduced once per step, during the last
    micro-batch's backward as soon as it is complete (with `overlap_grad_reduce`)."""

    every_microbatch = False

    def __init__(self, g: BucketGroup):
        self.g = g
        self.inflight = InFlight()
        self.reduced: set[int] = set()  # buckets whose reduction started in this backward
        self.in_backward = False
        self._views = g.precision.grad == g.precision.param
        self._inner: dict[int, torch.Tensor] = {}  # bucket index -> its gradient's part this rank's shard axis assigns it

    def allocate(self, b: Bucket, owned: Range) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's gradient storage, and its part over what this rank owns (the optimizer's)."""
        g = self.g
        grad = torch.zeros(b.world.size, dtype=g.precision.grad, device=g.buffer.device)
        g.ledger.hold("grads", nbytes(grad))
        if self._views:
            for i in b.params:  # autograd accumulates straight into the bucket
                p = g.buffer.params[i]
                p.grad = grad[g.buffer.spans[i]].view(p.shape)
        self._inner[b.index] = grad[b.local(g.inner(b))]
        return grad, grad[b.local(owned)]

    def landing(self, b: Bucket) -> torch.Tensor:
        """The full-bucket tensor a parameter's gradient is added into."""
        return self.g.grads[b.index]

    def inner_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced shard of `b`'s gradient."""
        return self._inner[b.index]

    def begin_backward(self, last_microbatch: bool) -> None:
        self.in_backward = self.g.overlap_grad_reduce and last_microbatch
        self.reduced = set()

    def per_grad(self) -> bool:
        """Whether this backward needs each gradient as it lands: not while autograd accumulates
        into the buckets' views and no reduction starts (every micro-batch but the last)."""
        return self.in_backward or not self._views

    def on_grad(self, i: int, b: Bucket, param: nn.Parameter) -> None:
        if param.grad is not None and not self._views:
            accumulate(self.g, self.landing(b), i, param)
        if self.in_backward and self.g.buffer.pending(b) == 0:
            self.start(b)

    def after_backward(self, last_microbatch: bool) -> None:
        """Gradients stay in the full buckets until the last micro-batch."""

    def start(self, b: Bucket) -> None:
        if b.index in self.reduced or not self.g.buffer.trainable(b):
            return
        self.reduced.add(b.index)
        grad = self.g.grads[b.index]
        comm = to_comm(self.g, grad)
        work = self._collective(comm)

        def then():
            if comm is not grad:
                self._keep(b, grad, comm)
            free_comm(self.g, comm, grad)

        self.inflight.add(b.index, work, then)

    def finish(self) -> None:
        self.inflight.finish()
        self.reduced = set()

    def _collective(self, comm: torch.Tensor) -> dist.Work | None:
        return self.g.axis.start_all_reduce(comm)

    def _keep(self, b: Bucket, grad: torch.Tensor, comm: torch.Tensor) -> None:
        """Copy the sums back from a communication copy of another dtype."""
        grad.copy_(comm)


class ReduceScatterAtEnd(AllReduceAtEnd):
    """ZeRO-1: DDP's full gradient buckets, each reduce-scattered once per step instead: the
    sums of this rank's shard land in its place in the bucket (the rest is scratch)."""

    def _collective(self, comm: torch.Tensor) -> dist.Work | None:
        return self.g.axis.start_reduce_scatter(comm)

    def _keep(self, b: Bucket, grad: torch.Tensor, comm: torch.Tensor) -> None:
        self._inner[b.index].copy_(self.g.axis.chunk(comm))


class ReduceScatterPerBucket:
    """ZeRO-2/3: a rank keeps only its shard of each bucket's gradient. Every micro-batch, a
    full bucket is allocated when backward first adds into it, reduce-scattered once complete,
    its shard of the sums added into the kept shard, and freed; one bucket's reduction is in
    flight besides the one filling, which bounds the transient memory to two full buckets."""

    every_microbatch = True

    def __init__(self, g: BucketGroup):
        self.g = g
        self.inflight = InFlight()
        self.reduced: set[int] = set()
        self.in_backward = False
        self._landing: dict[int, torch.Tensor] = {}

    def allocate(self, b: Bucket, owned: Range) -> tuple[torch.Tensor, torch.Tensor]:
        g, inner = self.g, self.g.inner(b)
        grad = torch.zeros(inner.size, dtype=g.precision.grad, device=g.buffer.device)
        g.ledger.hold("grads", nbytes(grad))
        return grad, grad[owned.shift(-inner.start).slice()]

    def landing(self, b: Bucket) -> torch.Tensor:
        if b.index not in self._landing:
            full = torch.zeros(b.world.size, dtype=self.g.precision.grad, device=self.g.buffer.device)
            self.g.ledger.grow(nbytes(full))
            self._landing[b.index] = full
        return self._landing[b.index]

    def inner_grad(self, b: Bucket) -> torch.Tensor:
        return self.g.grads[b.index]

    def begin_backward(self, last_microbatch: bool) -> None:
        self.in_backward = self.g.overlap_grad_reduce
        self.reduced = set()

    def per_grad(self) -> bool:
        return True  # each gradient is added into its landing bucket

    def on_grad(self, i: int, b: Bucket, param: nn.Parameter) -> None:
        if param.grad is not None:
            accumulate(self.g, self.landing(b), i, param)
        if self.in_backward and self.g.buffer.pending(b) == 0:
            self.start(b)

    def after_backward(self, last_microbatch: bool) -> None:
        for b in self.g.buckets:  # parameters that got no gradient: reduce zeros
            self.start(b)
        if not last_microbatch:
            self.finish()

    def start(self, b: Bucket) -> None:
        if b.index in self.reduced:
            return
        self.inflight.finish()  # the previous bucket's, so that two full buckets at most are alive
        if not self.g.buffer.trainable(b):
            return
        self.reduced.add(b.index)
        g, full = self.g, self.landing(b)
        for i in b.params:  # no view of the landing outlives it (a parameter that got no gradient)
            g.buffer.params[i].grad = None
        comm = to_comm(g, full)
        work = g.axis.start_reduce_scatter(comm)

        def then():
            g.grads[b.index].add_(g.axis.chunk(comm))
            free_comm(g, comm, full)
            g.ledger.shrink(nbytes(self._landing.pop(b.index)))

        self.inflight.add(b.index, work, then)

    def finish(self) -> None:
        self.inflight.finish()
        self.reduced = set()
