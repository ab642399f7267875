"""The collectives of one process-group axis, as start handles, with gloo's gaps filled.

Every `start_*` returns a `torch.distributed.Work` (or None on a group of one): a reader
sees where communication begins, and `wait()` marks where it must end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Axis:
    """One group of ranks: its size, this rank's index in it, and its collectives."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int):
        """`group` None with `size` > 1: the shape of an axis, for building on the meta
        device before any process group exists (its collectives must not be called)."""
        self.group, self.size, self.rank = group, size, rank
        # gloo has no reduce-scatter: it emulates one with an all-reduce plus copies, which
        # for a 16 MiB bucket allocates ~130 MiB. An in-place all-reduce gives the same sums
        # in this rank's chunk with no allocation (the rest of the tensor is scratch).
        self._gloo = size > 1 and group is not None and dist.get_backend(group) == "gloo"

    def chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's equal share of `full` (a view)."""
        n = full.numel() // self.size
        return full[self.rank * n : (self.rank + 1) * n]

    def start_all_reduce(self, t: torch.Tensor) -> dist.Work | None:
        if self.size == 1:
            return None
        return dist.all_reduce(t, group=self.group, async_op=True)

    def start_reduce_scatter(self, full: torch.Tensor) -> dist.Work | None:
        """Sum `full` across the group into this rank's `chunk(full)`; the rest is scratch."""
        if self.size == 1:
            return None
        if self._gloo:
            return dist.all_reduce(full, group=self.group, async_op=True)
        return _reduce_scatter(self.chunk(full), full, group=self.group, async_op=True)

    def start_all_gather(self, full: torch.Tensor, local: torch.Tensor) -> dist.Work | None:
        """Fill `full` with every rank's `local`: a separate tensor, or `chunk(full)` itself."""
        if self.size == 1:
            if local.data_ptr() != full.data_ptr():
                full.copy_(local)
            return None
        return _all_gather(full, local, group=self.group, async_op=True)


def wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


class _Summed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        out = x.clone()
        dist.all_reduce(out, group=axis.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def summed(part: torch.Tensor, axis: Axis) -> torch.Tensor:
    """A sum over this rank's tokens made the sum over the tokens of every rank of `axis` (the
    ranks a sequence is split over: cp, or tp under sequence parallelism). Every rank then
    computes the same function of it, which counts once; its gradient goes back unchanged to
    each rank's part, the part its own tokens make."""
    return part if axis.size == 1 else _Summed.apply(part, axis)
