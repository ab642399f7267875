"""Contiguous per-bucket storage of a model's parameters, laid out by `build_layout`.

Each bucket's compute parameters live in one flat tensor and every parameter of the model
becomes a view into it, so a bucket's collective runs on one contiguous slice. A bucket's
storage can be released and restored in place (ZeRO-3 keeps only a shard at rest): views,
and tensors autograd saved from them, see the restored values.

Gradients reach the strategy through one post-accumulate hook per trainable parameter,
counted per bucket, so a strategy learns when a bucket's gradients are final during backward.
Frozen parameters (`requires_grad=False`) get no hook and never a gradient.

A bucket's initial values come from a `ParamSource`: whole parameters (a seeded init), or
element ranges of them (pretrained weights read from storage, where a rank reads only its
shard and the strategy all-gathers the rest).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from rayzero.sharding.layout import Bucket, Layout, Range

Fill = Callable[[str, torch.Tensor], None]  # fill(name, fp32 out) writes a parameter's values


def weak_hook(owner, method: str, *first) -> Callable:
    """A hook for autograd that calls `owner.method(*first, *args)` while `owner` lives, holding
    it weakly. Autograd keeps a hook in its C++ state, where the garbage collector cannot see it:
    a hook holding its owner strongly keeps the owner (the buffers, the model, the strategy and
    its process groups) alive after the rank drops them."""
    ref = weakref.ref(owner)

    def hook(*args):
        me = ref()
        return getattr(me, method)(*first, *args) if me is not None else None

    return hook


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `name` (flattened, of shape `shape`), to be written
    in fp32 into `out` (1-D, end - start elements)."""

    name: str
    start: int
    end: int
    shape: tuple[int, ...]
    out: torch.Tensor


class ParamSource:
    """Where parameters' initial fp32 values come from, by `named_parameters()` name.

    `fill(name, out)` writes a whole parameter; `fill_pieces` writes element ranges of several.
    `partial` says that a range costs less than the whole (weights read from storage): a rank
    then reads only its shard of each bucket and the others' parts arrive by all-gather."""

    partial = False

    def fill(self, name: str, out: torch.Tensor) -> None:
        raise NotImplementedError

    def fill_pieces(self, pieces: list[Piece]) -> None:
        # A parameter's pieces come one after another (a row-parallel weight's TP slice is a
        # run per row): its whole tensor is made once for all of them, and kept no longer.
        name, whole = None, None
        for p in pieces:
            if p.end - p.start == p.out.numel() == _numel(p.shape):
                self.fill(p.name, p.out.view(p.shape))
                continue
            if p.name != name:
                name, whole = p.name, torch.empty(p.shape, dtype=torch.float32)
                self.fill(name, whole)
            p.out.copy_(whole.view(-1)[p.start : p.end])


class FillSource(ParamSource):
    """A plain `fill(name, out)` function as a source."""

    def __init__(self, fill: Fill):
        self._fill = fill

    def fill(self, name: str, out: torch.Tensor) -> None:
        self._fill(name, out)


class Zeros(ParamSource):
    """Zeros, for parameters whose values a checkpoint brings next (nothing computed or read)."""

    def fill(self, name: str, out: torch.Tensor) -> None:
        out.zero_()

    def fill_pieces(self, pieces: list[Piece]) -> None:
        for p in pieces:
            p.out.zero_()


class PerName(ParamSource):
    """Each parameter from `first` if its name is in `names`, else from `rest`: pretrained
    weights for what the files hold, a seeded init for what they do not (adapters)."""

    def __init__(self, first: ParamSource, names: set[str], rest: ParamSource):
        self.first, self.names, self.rest = first, names, rest
        self.partial = first.partial

    def fill(self, name: str, out: torch.Tensor) -> None:
        (self.first if name in self.names else self.rest).fill(name, out)

    def fill_pieces(self, pieces: list[Piece]) -> None:
        self.first.fill_pieces([p for p in pieces if p.name in self.names])
        self.rest.fill_pieces([p for p in pieces if p.name not in self.names])

    @property
    def bytes_read(self):
        return getattr(self.first, "bytes_read", None)


def as_source(source: ParamSource | Fill) -> ParamSource:
    return source if isinstance(source, ParamSource) else FillSource(source)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


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
        self._ptrs: frozenset[int] | None = None  # storage_ptrs(), until a bucket's storage changes
        self._nbytes = [b.world.size * dtype.itemsize for b in layout.buckets]
        # each parameter's slice of its bucket's tensors (data, gradients), asked per micro-batch
        self.spans = [layout.buckets[p.bucket].local(p.world) for p in layout.params]
        self._on_grad: Callable[[int, nn.Parameter], None] | None = None
        self._pending: list[int] = []

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self.layout.buckets

    def bucket_of(self, param_index: int) -> int:
        return self.layout.params[param_index].bucket

    def nbytes(self, bucket: Bucket) -> int:
        return self._nbytes[bucket.index]

    def trainable(self, bucket: Bucket) -> bool:
        """Whether the bucket's parameters train (a bucket holds only trainable or only frozen ones)."""
        return self.params[bucket.params[0]].requires_grad

    # -- storage ---------------------------------------------------------------------
    def materialize(self, bucket: Bucket, source: ParamSource | Fill) -> torch.Tensor:
        """Allocate `bucket`'s storage, point its parameters at views of it, and fill them.

        Returns the bucket's values in fp32 (the compute storage itself when that is fp32),
        padding zeroed, so the caller can take fp32 main parameters before any rounding.
        """
        return self.install(bucket, self.initial_values(bucket, source))

    def initial_values(self, bucket: Bucket, source: ParamSource | Fill, only: Range | None = None) -> torch.Tensor:
        """The bucket's initial values in fp32, padding zeroed: every parameter whole, or with
        `only` (world coordinates) just the elements inside it, the rest left zero."""
        source = as_source(source)
        full32 = torch.zeros(bucket.world.size, dtype=torch.float32, device=self.device)
        if only is None:
            for i in bucket.params:
                span = self.layout.params[i].world.shift(-bucket.world.start)
                source.fill(self.names[i], full32[span.slice()].view(self.params[i].shape))
            return full32
        pieces = []
        for i in bucket.params:
            span = self.layout.params[i].world
            cut = span.intersect(only)
            if cut is not None:
                local = cut.shift(-bucket.world.start)
                pieces.append(Piece(self.names[i], cut.start - span.start, cut.end - span.start,
                                    tuple(self.params[i].shape), full32[local.slice()]))
        source.fill_pieces(pieces)
        return full32

    def install(self, bucket: Bucket, full32: torch.Tensor) -> torch.Tensor:
        """Make `full32` (or its rounding to the compute dtype) the bucket's storage and its
        parameters views of it; returns `full32`."""
        data = full32 if self.dtype == torch.float32 else full32.to(self.dtype)
        self.data[bucket.index] = data
        self._ptrs = None
        fresh = {}
        for i in bucket.params:
            span = self.layout.params[i].world.shift(-bucket.world.start)
            # `.data` detaches the version counter: in-place writes to the bucket (a gather
            # between forward and backward) must not invalidate tensors autograd saved.
            old = self.params[i]
            new = nn.Parameter(data[span.slice()].view(old.shape).data, requires_grad=old.requires_grad)
            if old.requires_grad:
                new.register_post_accumulate_grad_hook(self._make_hook(i))
            fresh[id(self.params[i])] = new
            self.params[i] = new
        _swap_parameters(self.model, fresh)
        return full32

    def release(self, bucket: Bucket) -> None:
        """Free the bucket's storage; its parameters stay as views of zero-size storage."""
        self.data[bucket.index].untyped_storage().resize_(0)
        self._ptrs = None

    def restore(self, bucket: Bucket) -> None:
        """Give the bucket its storage back (contents undefined until written)."""
        storage = self.data[bucket.index].untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._nbytes[bucket.index])
            self._ptrs = None

    def storage_ptrs(self) -> frozenset[int]:
        """The data pointers of the buckets' storages: what the activation meter leaves out (a
        forward saves parameters for its backward). Asked for every saved tensor, so it is kept
        until a bucket is installed, released or restored."""
        if self._ptrs is None:
            self._ptrs = frozenset(d.untyped_storage().data_ptr() for d in self.data if d is not None)
        return self._ptrs

    def is_resident(self, bucket: Bucket) -> bool:
        return self.data[bucket.index].untyped_storage().nbytes() > 0

    # -- gradient hooks ----------------------------------------------------------------
    def arm(self, on_grad: Callable[[int, nn.Parameter], None]) -> None:
        """Call `on_grad(i, param)` as each parameter's gradient becomes final in the next
        backward; `pending(bucket)` counts what is left per bucket."""
        self._on_grad = on_grad
        self._pending = [sum(self.params[i].requires_grad for i in b.params) for b in self.buckets]

    def disarm(self) -> None:
        self._on_grad = None

    def pending(self, bucket: Bucket) -> int:
        return self._pending[bucket.index] if self._on_grad is not None else 0

    def _make_hook(self, i: int):
        return weak_hook(self, "landed", i)  # kept by the parameter, in autograd's C++ state

    def landed(self, i: int, param: nn.Parameter) -> None:
        """Parameter `i`'s gradient is final for this backward (autograd's accumulation hook, or
        a split backward that wrote `.grad` itself)."""
        if self._on_grad is None:
            return
        self._pending[self.layout.params[i].bucket] -= 1
        self._on_grad(i, param)

    def named_views(self) -> dict[str, nn.Parameter]:
        return dict(zip(self.names, self.params))


def _swap_parameters(model: nn.Module, fresh: dict[int, nn.Parameter]) -> None:
    """Replace parameters by identity everywhere they are registered (tied weights stay tied)."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in fresh:
                module._parameters[key] = fresh[id(p)]
