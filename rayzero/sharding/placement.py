"""Where parameters live: the placement column of the table in strategies.py.

    WholeParams    DDP, ZeRO-1, ZeRO-2: every rank holds every parameter, in the flat buffer
    ShardedUnits   ZeRO-3 (fsdp.py): a rank holds its shard of each bucket; each FSDP unit is
                   gathered around its forward and backward (start/finish its all-gather,
                   then release it)

A placement lays out the buffer (which parameters share a bucket, in which order), keeps the
compute parameters (`hold`), hands out views of what it keeps (`view`) or the whole bucket
(`whole`), and is told of backward's progress (`on_grad`, `after_backward`,
`after_forward_only`) so that it can release what is no longer needed. A placement acts on
one bucket group (group.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from rayzero.sharding.config import ShardingConfig
from rayzero.sharding.layout import Bucket, Layout, Range, auto_bucket_numel, build_layout

if TYPE_CHECKING:
    from rayzero.sharding.group import BucketGroup


class WholeParams:
    """Parameters whole at rest: the flat buffer's buckets are their storage, and forward and
    backward find them there; nothing to gather or release around them."""

    whole_at_rest = True

    def __init__(self, g: BucketGroup, model: nn.Module, grad_sync, units: tuple[str, ...]):
        """As every placement is built (ShardedUnits reads the model, the gradient policy and the
        units); whole parameters need only the group."""
        self.g = g

    @staticmethod
    def layout(model: nn.Module, sharding: ShardingConfig, dp_size: int,
               alone: frozenset[str] = frozenset(), experts: frozenset[str] = frozenset(),
               cpu: bool = False) -> tuple[list, Layout]:
        # Reverse order: backward produces the last layers' gradients first, so the first
        # bucket fills first and its reduction can start while backward goes on. Frozen
        # parameters go last, in buckets of their own; so do `alone` ones (a pipeline's tied),
        # and a model's `experts` (a bucket group of their own) go after the dense ones.
        key = {n: (n in experts, not p.requires_grad, n in alone) for n, p in model.named_parameters()}
        named = sorted(reversed(list(model.named_parameters())), key=lambda item: key[item[0]])
        groups = [4 * e + 2 * f + a for e, f, a in (key[n] for n, _ in named)]
        trainable = sum(p.numel() for _, p in named if p.requires_grad)
        numel = sharding.bucket_numel
        if numel == "auto":
            numel = auto_bucket_numel(trainable, dp_size, cpu)
        return named, build_layout([p.numel() for _, p in named], dp_size, numel, sharding.shard_align,
                                   groups if any(groups) else None)

    def hold(self, b: Bucket, category: str) -> None:
        """Keep the bucket's compute parameters (all of them: they stay in the buffer)."""
        self.g.ledger.hold(category, self.g.buffer.nbytes(b))

    def view(self, b: Bucket, r: Range) -> torch.Tensor:
        """The compute parameters of `b` over `r`, a view of the resident storage."""
        return self.g.buffer.data[b.index][b.local(r)]

    def whole(self, b: Bucket) -> torch.Tensor:
        """The bucket's compute parameters, whole."""
        return self.g.buffer.data[b.index]

    per_grad = False  # nothing to release as gradients come in

    def on_grad(self, i: int, b: Bucket) -> None:
        """Nothing to release as gradients come in."""

    def begin_backward(self) -> None:
        """Nothing to gather before backward."""

    def after_backward(self) -> None:
        """Nothing to release after backward."""

    def after_forward_only(self) -> None:
        """Nothing to release after evaluation."""
