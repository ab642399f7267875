"""Where a forward first reads each bucket's parameters, learned by watching one forward.

With `overlap_param_gather`, the updated parameters' all-gather runs during the next forward,
and each module's forward first waits for the buckets of its own parameters (ownership.py).
A forward may read a parameter without calling the module that holds it:
`F.linear(h, self.attn.in_proj_weight)`, a head computed from an embedding's weight. Such a
read would take the parameter while its all-gather still writes it: values of the step before,
on some ranks and not others, depending on timing.

So the first forward that runs while a gather is in flight is watched (`FirstReads.arm()`): a
`TorchFunctionMode` sees every tensor an op takes, and global module hooks keep the stack of
modules running. A parameter whose bucket is still in flight is waited for at that op (reads
of its metadata, dtype or shape, are not reads of it), and the innermost module running waits
for that bucket at its own start in every forward after (`owner.wait_before`). The watch ends
once a forward leaves no bucket in flight, or when the whole gather is waited for (before a
step; then, if no forward ran, the next gather is watched). Waiting changes no value, only
when a rank waits, so a watched forward computes bit for bit what any other does.
"""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch
import torch.nn as nn
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode


class FirstReads:
    """The watch for one bucket group's all-gather, over `model`, for `owner` (ownership.py's
    `OwnShard`), which it asks:

        owner.read_buckets()         the bucket of each of the group's parameters now, by `id`
                                     (the buffer swaps parameter objects)
        owner.in_flight(bucket)      whether its all-gather is still in flight
        owner.finish(buckets)        wait for them
        owner.wait_before(module, buckets)
                                     from now on, `module`'s forward waits for `buckets` first

    The owner is held weakly: a rank drops its strategy without telling it, and a watch still
    armed then must neither keep the model alive nor outlive it (its hooks go with it)."""

    def __init__(self, model: nn.Module, owner):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.owner = weakref.ref(owner)
        self.armed = self.done = False
        self.forwards = 0  # forwards watched since armed
        self.found: list[tuple[str, int]] = []  # (the module running a read, the bucket it waits for)
        self._of: dict[int, int] = {}

    def arm(self) -> None:
        """Watch the forwards from now until one leaves nothing in flight (once per process)."""
        if self.done or self.armed:
            return
        self.armed, self.forwards, self._of = True, 0, self.owner().read_buckets()
        _Watch.add(self)

    def alive(self) -> bool:
        return self.owner() is not None

    def watches(self, module: nn.Module) -> bool:
        return id(module) in self.names and self.alive()

    def saw(self, tensor, stack: list[nn.Module]) -> None:
        b, owner = self._of.get(id(tensor)), self.owner()
        if b is not None and owner is not None and owner.in_flight(b):
            owner.finish([b])
            self.found.append((self.names[id(stack[-1])], b))
            owner.wait_before(stack[-1], [b])

    def pending(self) -> bool:
        owner = self.owner()
        return owner is not None and any(owner.in_flight(b) for b in set(self._of.values()))

    def forward_ended(self) -> None:
        self.forwards += 1

    def gathered(self) -> None:
        """Nothing is in flight any more: the watch ends, for good if it saw a forward (else the
        next gather arms it again)."""
        if self.armed:
            self.armed, self.done = False, self.forwards > 0
            _Watch.remove(self)


_T = torch.Tensor
# What reads a parameter's metadata, not its values (PEFT's LoRA layer asks its adapter's dtype
# before calling it): no wait there, which would come earlier than the values are needed.
METADATA = frozenset({_T.dtype.__get__, _T.shape.__get__, _T.device.__get__, _T.requires_grad.__get__,
                      _T.ndim.__get__, _T.is_leaf.__get__, _T.grad.__get__, _T.layout.__get__, _T.is_cuda.__get__,
                      _T.size, _T.dim, _T.numel, _T.nelement, _T.stride, _T.element_size, _T.is_floating_point,
                      _T.is_contiguous, _T.data_ptr})


class _Reads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _Watch.stack and func not in METADATA:
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, nn.Parameter):
                        for w in _Watch.watches:
                            w.saw(t, _Watch.stack)
        return func(*args, **kwargs)


class _Watch:
    """The process's one watch: its module hooks and its mode, shared by the armed `FirstReads`
    (one per bucket group: one mode, so that modes enter and leave in order)."""

    watches: ClassVar[list[FirstReads]] = []
    stack: ClassVar[list[nn.Module]] = []
    _mode: _Reads | None = None
    _handles: ClassVar[list] = []

    @classmethod
    def add(cls, w: FirstReads) -> None:
        cls.watches.append(w)
        if not cls._handles:
            cls._handles = [_module.register_module_forward_pre_hook(cls._enter),
                            _module.register_module_forward_hook(cls._leave, always_call=True)]

    @classmethod
    def remove(cls, w: FirstReads) -> None:
        cls.watches.remove(w)
        if not cls.watches and not cls.stack:
            cls._unhook()

    @classmethod
    def _unhook(cls) -> None:
        for h in cls._handles:
            h.remove()
        cls._handles = []

    @classmethod
    def _enter(cls, module: nn.Module, _args) -> None:
        if not cls.stack:  # a watch whose owner was dropped (a rank left its group) goes
            for w in [w for w in cls.watches if not w.alive()]:
                w.gathered()
            if not cls.watches:
                return
        if not any(w.watches(module) for w in cls.watches):
            return
        if not cls.stack:
            cls._mode = _Reads()
            cls._mode.__enter__()
        cls.stack.append(module)

    @classmethod
    def _leave(cls, module: nn.Module, _args, _out) -> None:
        if not cls.stack or cls.stack[-1] is not module:
            return
        cls.stack.pop()
        if cls.stack:
            return
        cls._mode.__exit__(None, None, None)
        cls._mode = None
        for w in list(cls.watches):
            w.forward_ended()
            if not w.pending():
                w.gathered()
        if not cls.watches:
            cls._unhook()
