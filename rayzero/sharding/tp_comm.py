"""The tensor-parallel group's communication: Megatron's "f" and "g" operators, and their
sequence-parallel forms, as autograd functions.

    f  copy_to_tp       forward: identity          backward: all-reduce over the TP group
    g  reduce_from_tp   forward: all-reduce        backward: identity

The column-parallel linears of one module (q, k and v; gate and up) share one "f", applied
once to the module's input (`tensor_parallel._SharedInput`), so their input gradients are
summed locally first and all-reduced once.

With sequence parallelism "f" becomes an all-gather of the sequence shards (backward: a
reduce-scatter) and "g" a reduce-scatter to them (backward: an all-gather): the same bytes as
the all-reduces they replace. `split_sequence` and `whole_sequence` enter and leave the
sequence-parallel region around the replicated layers.

Pure torch (no Ray).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayzero.sharding.comm import Axis


class _CopyToTP(torch.autograd.Function):
    """f: the same input on every TP rank; the gradients each rank's part computes are summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.axis.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: the partial outputs of the TP ranks, summed; the gradient passes through whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=axis.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _CopyToTP.apply(x, axis)


def reduce_from_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _ReduceFromTP.apply(x, axis)


SEQ = 1  # activations are (batch, sequence, features)


def _all_gather_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(axis.size)]
    dist.all_gather(parts, x.contiguous(), group=axis.group)
    return torch.cat(parts, dim=SEQ)


def _reduce_scatter_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The sum over the group of `x`, this rank's sequence chunk of it. gloo has no
    reduce-scatter: an all-reduce of the whole (the same bytes as the all-reduce it replaces)."""
    x = x.contiguous()
    if axis._gloo:
        whole = x.clone()
        dist.all_reduce(whole, group=axis.group)
        return whole.chunk(axis.size, dim=SEQ)[axis.rank].contiguous()
    out = torch.empty_like(x.chunk(axis.size, dim=SEQ)[0])
    dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(axis.size, dim=SEQ)], group=axis.group)
    return out


def _own_chunk(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x.chunk(axis.size, dim=SEQ)[axis.rank].contiguous()


class _GatherSequence(torch.autograd.Function):
    """f with sequence parallelism: the sequence shards gathered; gradient reduce-scattered."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _all_gather_seq(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.axis), None


class _ScatterSequence(torch.autograd.Function):
    """g with sequence parallelism: partial outputs summed into sequence shards; gradient gathered."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _reduce_scatter_seq(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.axis), None


class _SplitSequence(torch.autograd.Function):
    """Into the sequence-parallel region: this rank's chunk of a whole (identical) sequence;
    gradient gathered."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _own_chunk(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.axis), None


class _WholeSequence(torch.autograd.Function):
    """Out of the sequence-parallel region, to replicated layers: the shards gathered; the
    gradient (the same on every rank) split back."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _all_gather_seq(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.axis), None


@dataclass(frozen=True)
class TPComm:
    """The TP group's transitions: into the column-parallel region ("f", or with sequence
    parallelism an all-gather of the sequence shards) and out of the row-parallel one ("g",
    or a reduce-scatter to sequence shards)."""

    axis: Axis
    sequence_parallel: bool = False

    def into_columns(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis.size == 1:
            return x
        return _GatherSequence.apply(x, self.axis) if self.sequence_parallel else copy_to_tp(x, self.axis)

    def out_of_rows(self, y: torch.Tensor) -> torch.Tensor:
        if self.axis.size == 1:
            return y
        return _ScatterSequence.apply(y, self.axis) if self.sequence_parallel else reduce_from_tp(y, self.axis)


def split_sequence(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _SplitSequence.apply(x, axis)


def whole_sequence(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return _WholeSequence.apply(x, axis)
