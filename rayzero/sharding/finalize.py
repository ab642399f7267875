"""The model's gradient fix-ups after the reduction (Megatron's `finalize_model_grads`): each a
small class the strategy chooses at build where it applies, run in order at the end of
`finish_grad_sync` on the reduced gradient shards, not a branch in the step.

    TiedSum        a pipeline's weight held by two stages: its gradient summed over them
    TPPartialSum   a replicated parameter whose gradient each tensor-parallel rank holds a part of
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayzero.sharding.comm import Axis


@dataclass(frozen=True)
class Tied:
    """Parameters a pipeline stage shares with another (a tied embedding on the first and last
    stages): each in a bucket of its own, sharded alike on both, whose reduced gradients are
    summed over `axis` (Megatron's embedding group) before the step, so both copies take the same
    update; `counts` on one of them only, for the global norm."""

    names: frozenset[str]
    axis: Axis
    counts: bool



class TiedSum:
    """A pipeline's tied weight (the input embedding reused as the head, on the first and the
    last stage): the same shard of the same bucket on both stages, summed over them (Megatron's
    embedding group)."""

    def __init__(self, axis, buckets: list[int]):
        self.axis, self.buckets = axis, buckets

    def __call__(self, main_grads: list[torch.Tensor]) -> None:
        for b in self.buckets:
            dist.all_reduce(main_grads[b], group=self.axis.group)


class TPPartialSum:
    """Replicated parameters whose gradient each tensor-parallel rank holds a part of (key/value
    heads fewer than the TP ranks): the parts summed over the `tp` role, on the reduced shards."""

    def __init__(self, axis, pieces: list[tuple[int, slice]]):
        self.axis, self.pieces = axis, pieces

    def __call__(self, main_grads: list[torch.Tensor]) -> None:
        for b, cut in self.pieces:
            dist.all_reduce(main_grads[b][cut], group=self.axis.group)
