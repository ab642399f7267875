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
        # gloo has no reduce-scatter (it emulates one with an all-reduce plus copies: ~130 MiB
        # for a 16 MiB bucket), and its all-gather copies too. Both are point-to-point here:
        # each rank sends every peer the chunk that peer sums (its own shard, to gather), which
        # moves (size - 1) / size of a bucket per rank each way, where an all-reduce moves
        # twice that: 0.33-0.64x the time for a reduce-scatter, 0.43-0.76x for an all-gather,
        # at 2 and 4 ranks and 1-16 MiB (`benchmarks/collectives.py`).
        self._gloo = size > 1 and group is not None and dist.get_backend(group) == "gloo"
        self._peers = [(j, r) for j, r in enumerate(dist.get_process_group_ranks(group)) if j != rank] \
            if self._gloo else []
        self._sent = 0  # point-to-point exchanges started: each one's tag, the same on every rank

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
            return self._exchange_sums(full)
        return _reduce_scatter(self.chunk(full), full, group=self.group, async_op=True)

    def start_all_gather(self, full: torch.Tensor, local: torch.Tensor) -> dist.Work | None:
        """Fill `full` with every rank's `local`: a separate tensor, or `chunk(full)` itself."""
        if self.size == 1:
            if local.data_ptr() != full.data_ptr():
                full.copy_(local)
            return None
        if self._gloo:
            return self._exchange_shards(full, local)
        return _all_gather(full, local, group=self.group, async_op=True)

    # -- gloo: the two as point-to-point exchanges --------------------------------------------
    def _tag(self) -> int:
        self._sent += 1
        return 1 + self._sent % (1 << 20)

    def _exchange_sums(self, full: torch.Tensor) -> Exchange:
        """Send each peer its chunk of `full`, receive every peer's part of this rank's chunk,
        and (at `wait()`) sum the parts in rank order into `chunk(full)`."""
        n, tag = full.numel() // self.size, self._tag()
        flat = torch.empty(len(self._peers) * n, dtype=full.dtype, device=full.device)  # flat, as buckets are
        parts = [flat[k * n:(k + 1) * n] for k in range(len(self._peers))]
        works = []
        for part, (j, peer) in zip(parts, self._peers):
            works.append(dist.isend(full[j * n:(j + 1) * n], peer, group=self.group, tag=tag))
            works.append(dist.irecv(part, peer, group=self.group, tag=tag))
        mine = self.chunk(full)

        def add() -> None:
            ordered = [*parts[:self.rank], mine, *parts[self.rank:]]  # every rank's part, in rank order
            total = ordered[0]
            for part in ordered[1:]:
                total.add_(part)
            if total is not mine:
                mine.copy_(total)

        return Exchange(works, add)

    def _exchange_shards(self, full: torch.Tensor, local: torch.Tensor) -> Exchange:
        """Send `local` to every peer and receive theirs into their chunks of `full`."""
        n, tag = full.numel() // self.size, self._tag()
        works = []
        for j, peer in self._peers:
            works.append(dist.isend(local, peer, group=self.group, tag=tag))
            works.append(dist.irecv(full[j * n:(j + 1) * n], peer, group=self.group, tag=tag))
        mine = self.chunk(full)
        if local.data_ptr() != mine.data_ptr():
            mine.copy_(local)
        return Exchange(works)


class Exchange:
    """Point-to-point sends and receives started together, as one collective's handle:
    `wait()` waits for them all, then runs what completes the collective."""

    def __init__(self, works: list, then=None):
        self.works, self.then = works, then

    def wait(self) -> bool:
        works, self.works = self.works, []
        for w in works:
            w.wait()
        if self.then is not None and works:
            self.then()
        return True


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
