"""Contiguous parameter and gradient storage for a model, laid out by `build_layout`.

After construction every parameter's ``.data`` and ``.grad`` are views into two flat
tensors, so autograd accumulates micro-batch gradients straight into the buffer and a
bucket's collective runs on one contiguous slice.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from rayzero.sharding.layout import Bucket, Layout, build_layout


class FlatBuffer:
    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        dp_size: int,
        bucket_numel: int,
        shard_align: int = 1,
    ):
        # Reverse order: backward produces the last layers' gradients first, so the first
        # bucket fills first and its reduction can start while backward goes on.
        self.named_params = list(reversed(named_params))
        self.params = [p for _, p in self.named_params]
        self.names = [n for n, _ in self.named_params]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"a FlatBuffer holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.device = self.params[0].device
        self.layout: Layout = build_layout(
            [p.numel() for p in self.params], dp_size, bucket_numel, shard_align
        )
        n = self.layout.numel
        self.param_data = torch.zeros(n, dtype=self.dtype, device=self.device)
        self.grad_data = torch.zeros(n, dtype=self.dtype, device=self.device)
        for p, span in zip(self.params, self.layout.params):
            view = self.param_data[span.world.slice()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            p.grad = self.grad_data[span.world.slice()].view(p.shape)
        self._on_bucket_ready: Callable[[Bucket], None] | None = None
        self._pending: list[int] = []
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(span.bucket))
            for p, span in zip(self.params, self.layout.params)
        ]

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self.layout.buckets

    def bucket_params(self, bucket: Bucket) -> torch.Tensor:
        return self.param_data[bucket.world.slice()]

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        return self.grad_data[bucket.world.slice()]

    def zero_grads(self) -> None:
        self.grad_data.zero_()

    def arm(self, on_bucket_ready: Callable[[Bucket], None] | None) -> None:
        """Call `on_bucket_ready(bucket)` during the next backward as each bucket's gradients
        become final; `None` disarms (the micro-batches before the last one)."""
        self._on_bucket_ready = on_bucket_ready
        self._pending = [len(b.params) for b in self.buckets]

    def unfired(self) -> list[Bucket]:
        """Armed buckets whose callback has not fired (some parameter got no gradient)."""
        if self._on_bucket_ready is None:
            return []
        return [b for b, left in zip(self.buckets, self._pending) if left > 0]

    def disarm(self) -> None:
        self._on_bucket_ready = None

    def _make_hook(self, bucket_index: int):
        def hook(_param: torch.Tensor) -> None:
            if self._on_bucket_ready is None:
                return
            self._pending[bucket_index] -= 1
            if self._pending[bucket_index] == 0:
                self._on_bucket_ready(self.buckets[bucket_index])

        return hook

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters by name (views into the buffer: clone before mutating)."""
        return {name: p.data for name, p in self.named_params}
