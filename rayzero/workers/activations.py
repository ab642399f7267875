"""Activations: recomputed in backward instead of kept (activation checkpointing), and measured.

`checkpoint_activations(model, blocks, mode)` makes each chosen block run its forward under
`torch.utils.checkpoint` (non-reentrant, the RNG state kept, and the rank's dropout streams
(`sharding.rng`) put back where they stood before the block, so dropout draws the same numbers
when the block is recomputed, in every stream, and results are bitwise those of a run without it). The block's
`forward` is replaced on the instance, not wrapped in another module: parameter and module
names stay the model's own, for checkpoints, exports and pretrained weights alike. `selective`
keeps the outputs of the block's matrix multiplications (and attention) and recomputes the
rest, torch's selective checkpoint policy as torchtitan's op-level mode uses it.

`ActivationMeter` counts the bytes a forward leaves saved for backward: every tensor autograd
saves whose storage is still alive when the forward ends, each storage once, parameters
excluded, and what checkpointing holds instead (each recomputed block's inputs; the outputs
`selective` keeps). It costs a Python call per saved tensor, so a rank measures a sample
(`sampled`): the first forwards of each kind (input shape, pipeline chunk) and then one in
`EVERY`; what a forward saves follows from its shapes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rayzero.models.spec import outermost
from rayzero.sharding.rng import RandomStreams

_aten = torch.ops.aten
# What `selective` keeps: the outputs of matrix multiplications and of attention, the costly
# ops; everything else in a block (norms, activations, elementwise) is recomputed.
KEEP = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
for _name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
    if hasattr(_aten, _name):
        KEEP.add(getattr(_aten, _name).default)


class ActivationMeter:
    """Saved-for-backward bytes of the forwards run under it (`with meter:`), each storage
    counted once, if it is still alive when the forward ends (a part of the graph that nothing
    uses is freed during the forward, and its address taken by a later tensor: counted by
    address alone, the sum would depend on the allocator); `exclude()` gives the storages not
    to count (the parameters')."""

    _current = threading.local()
    FIRST, EVERY = 2, 16  # `sampled`: each kind's first forwards measured, then one in EVERY

    def __init__(self, exclude: Callable[[], set[int]] = set):
        """`exclude()`: the data pointers of storages not to count (asked when a storage is first
        seen: a ZeRO-3 unit's parameters get their storage when it is gathered)."""
        self.exclude = exclude
        self.bytes = 0
        self._held: dict[int, tuple[list[weakref.ref], int]] = {}  # address -> (saved views, bytes)
        self._extra = 0  # bytes counted without a tensor (what `selective` keeps)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._forwards: dict = {}  # kind -> forwards run of it
        self._last: dict = {}  # kind -> bytes its last measured forward left
        self._kind = None

    def sampled(self, kind) -> "ActivationMeter | contextlib.nullcontext":
        """The meter to run a forward of `kind` under (what makes forwards alike: the input
        shape, the pipeline chunk) for the first `FIRST` forwards of each kind and then one in
        `EVERY`; otherwise nothing is measured and `bytes` is what the last measured forward
        of `kind` left."""
        n = self._forwards[kind] = self._forwards.get(kind, -1) + 1
        if n < self.FIRST or n % self.EVERY == 0:
            self._kind = kind
            return self
        self.bytes = self._last[kind]
        return contextlib.nullcontext()

    def __enter__(self) -> "ActivationMeter":
        self.bytes, self._held, self._extra = 0, {}, 0
        self._hooks.__enter__()
        ActivationMeter._current.meter = self
        return self

    def __exit__(self, *exc) -> None:
        ActivationMeter._current.meter = None
        self._hooks.__exit__(*exc)
        self.bytes = self._extra + sum(n for views, n in self._held.values() if _alive(views))
        self._held = {}
        self._last[self._kind] = self.bytes

    @classmethod
    def current(cls) -> "ActivationMeter | None":
        return getattr(cls._current, "meter", None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Count `t` and keep a detached alias: for an op's output, autograd hands the hook the
        output itself, which holds the op's node, which would hold what the hook returns: a
        cycle in autograd's C++ state that no garbage collection frees, so a part of the graph
        that nothing uses would never be freed."""
        t = t.detach()
        self.add(t)
        return t

    def add(self, t) -> None:
        """Count `t`'s storage (if it is a tensor, not excluded, and alive when the forward ends)."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            return
        ptr = st.data_ptr()
        # A parameter's storage is not remembered: a ZeRO-3 unit released after its forward
        # leaves its address free for an activation allocated later.
        if not ptr or ptr in self.exclude():
            return
        held = self._held.get(ptr)
        if held is not None and _alive(held[0]):
            held[0].append(weakref.ref(t))  # another view of a storage already counted
        else:  # new, or at the address of one freed since
            self._held[ptr] = ([weakref.ref(t)], st.nbytes())

    def add_bytes(self, n: int) -> None:
        self._extra += n


def _alive(views: list[weakref.ref]) -> bool:
    return any(v() is not None for v in views)


def _keep_matmuls(ctx, op, *args, **kwargs):
    if op in KEEP:
        meter = ActivationMeter.current()
        if meter is not None and not ctx.is_recompute:
            meter.add_bytes(_output_bytes(op, args))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _output_bytes(op, args) -> int:
    """The bytes of the output `selective` keeps for `op` (its shape from its inputs')."""
    if op in (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default):
        a, b = (args[1], args[2]) if op in (_aten.addmm.default, _aten.baddbmm.default) else (args[0], args[1])
        numel = a.numel() // a.shape[-1] * b.shape[-1]
        return numel * a.element_size()
    q, v = args[0], args[2]  # attention: the output is [..., query length, value width]
    return q.numel() // q.shape[-1] * v.shape[-1] * q.element_size()


def checkpoint_activations(model: nn.Module, blocks: list[str], selective: bool = False,
                           streams: RandomStreams | None = None) -> None:
    """Recompute the named blocks' activations in backward (see the module doc)."""
    modules = dict(model.named_modules())
    context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls) if selective else None
    for name in blocks:
        module = modules[name]
        module.forward = _recomputed(module.forward, context, streams)


def _recomputed(forward, context, streams: RandomStreams | None):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing would be kept anyway
            return forward(*args, **kwargs)
        meter = ActivationMeter.current()
        if meter is not None:  # held by the checkpoint until the recompute
            for a in tree_leaves((args, kwargs)):
                meter.add(a)
        extra = {"context_fn": context} if context is not None else {}
        if streams is None:
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
        before = streams.state()  # the recompute starts every stream from here again

        def replay(*a, **k):
            streams.restore(before)
            return forward(*a, **k)

        return checkpoint(replay, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    return run


def blocks_of(model: nn.Module, classes: tuple[str, ...], every: int) -> list[str]:
    """The modules of `classes` (the outermost where they nest), every `every`-th of them from
    the first. ValueError naming a class that matches no module, or a model with none."""
    names = {type(m).__name__ for m in model.modules()}
    missing = [c for c in classes if c not in names]
    if missing:
        raise ValueError(f"model.recompute_blocks: no module of {type(model).__name__} has class "
                         f"{', '.join(missing)}; its module classes are {', '.join(sorted(names))}")
    found = outermost(model, classes)
    if not found:
        raise ValueError(f"model.activation_checkpointing: {type(model).__name__} has no blocks to recompute; "
                         "name their class in model.recompute_blocks")
    return found[::every]
