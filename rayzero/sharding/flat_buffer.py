"""Contiguous per-bucket storage of a model's parameters, laid out by `build_layout`.

Each bucket's compute parameters live in one flat tensor and every parameter of the model
becomes a view into it, so a bucket's collective runs on one contiguous slice. A bucket's
storage can be released and restored in place (ZeRO-3 keeps only a shard at rest): views,
and tensors autograd saved from them, see the restored values.

Gradients reach the strategy through one post-accumulate hook per parameter, counted per
bucket, so a strategy learns when a bucket's gradients are final during backward.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from rayzero.sharding.layout import Bucket, Layout

Fill = Callable[[str, torch.Tensor], None]  # fill(name, fp32 out) writes a parameter's values


class FlatBuffer:
    def __init__(
        self,
        model: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """`named_params` in buffer order, matching `layout`. The model may live on the meta
        device: nothing is allocated until `materialize`."""
        if len(named_params) != len(layout.params):
            raise ValueError(f"{len(named_params)} parameters for a layout of {len(layout.params)}")
        self.model = model
        self.layout = layout
        self.names = [n for n, _ in named_params]
        self.params: list[nn.Parameter] = [p for _, p in named_params]
        self.dtype = dtype
        self.device = device
        self.data: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self._nbytes = [b.world.size * dtype.itemsize for b in layout.buckets]
        self._on_grad: Callable[[int, nn.Parameter], None] | None = None
        self._pending: list[int] = []

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self.layout.buckets

    def bucket_of(self, param_index: int) -> int:
        return self.layout.params[param_index].bucket

    def nbytes(self, bucket: Bucket) -> int:
        return self._nbytes[bucket.index]

    # -- storage ---------------------------------------------------------------------
    def materialize(self, bucket: Bucket, fill: Fill) -> torch.Tensor:
        """Allocate `bucket`'s storage, point its parameters at views of it, and fill them.

        Returns the bucket's values in fp32 (the compute storage itself when that is fp32),
        padding zeroed, so the caller can take fp32 main parameters before any rounding.
        """
        full32 = torch.zeros(bucket.world.size, dtype=torch.float32, device=self.device)
        for i in bucket.params:
            span = self.layout.params[i].world.shift(-bucket.world.start)
            fill(self.names[i], full32[span.slice()].view(self.params[i].shape))
        data = full32 if self.dtype == torch.float32 else full32.to(self.dtype)
        self.data[bucket.index] = data
        fresh = {}
        for i in bucket.params:
            span = self.layout.params[i].world.shift(-bucket.world.start)
            # `.data` detaches the version counter: in-place writes to the bucket (a gather
            # between forward and backward) must not invalidate tensors autograd saved.
            new = nn.Parameter(data[span.slice()].view(self.params[i].shape).data)
            new.register_post_accumulate_grad_hook(self._make_hook(i))
            fresh[id(self.params[i])] = new
            self.params[i] = new
        _swap_parameters(self.model, fresh)
        return full32

    def release(self, bucket: Bucket) -> None:
        """Free the bucket's storage; its parameters stay as views of zero-size storage."""
        self.data[bucket.index].untyped_storage().resize_(0)

    def restore(self, bucket: Bucket) -> None:
        """Give the bucket its storage back (contents undefined until written)."""
        storage = self.data[bucket.index].untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._nbytes[bucket.index])

    def is_resident(self, bucket: Bucket) -> bool:
        return self.data[bucket.index].untyped_storage().nbytes() > 0

    # -- gradient hooks ----------------------------------------------------------------
    def arm(self, on_grad: Callable[[int, nn.Parameter], None]) -> None:
        """Call `on_grad(i, param)` as each parameter's gradient becomes final in the next
        backward; `pending(bucket)` counts what is left per bucket."""
        self._on_grad = on_grad
        self._pending = [len(b.params) for b in self.buckets]

    def disarm(self) -> None:
        self._on_grad = None

    def pending(self, bucket: Bucket) -> int:
        return self._pending[bucket.index] if self._on_grad is not None else 0

    def _make_hook(self, i: int):
        b = self.layout.params[i].bucket

        def hook(param: nn.Parameter) -> None:
            if self._on_grad is None:
                return
            self._pending[b] -= 1
            self._on_grad(i, param)

        return hook

    def named_views(self) -> dict[str, nn.Parameter]:
        return dict(zip(self.names, self.params))


def _swap_parameters(model: nn.Module, fresh: dict[int, nn.Parameter]) -> None:
    """Replace parameters by identity everywhere they are registered (tied weights stay tied)."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in fresh:
                module._parameters[key] = fresh[id(p)]
