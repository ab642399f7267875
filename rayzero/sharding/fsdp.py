"""ZeRO-3 / FSDP's placement: parameters at rest are a shard; each FSDP unit is gathered around its use.

Units are the modules whose class is listed in `sharding.fsdp_units` (the outermost, when
they nest); each unit's parameters form one bucket of the flat buffer (two where the unit
holds frozen parameters too: those get a bucket without gradients). Parameters outside
every unit form a root unit, whole from the start of forward to the end of backward. A
module that uses another unit's parameter (a tied output head) gathers that unit too.

    forward   pre-hook: finish this unit's gather, start the next one's   post-hook: release
    backward  output-gradient hook: release finished units, finish this gather, start the
              previous unit's; when a unit's last gradient lands: reduce-scatter it, release
    recompute (activation checkpointing, inside backward): pre-hook: gather the unit if it is
              not whole and keep it for its backward, which follows; nothing else (the forward
              order, the backward hooks and the release belong to the real forward and backward)

The units that end a forward (the last two hooked modules', the last one's without prefetch)
are not released after it: the backward starts with them (`_ends_forward`). An embedding's
backward reads none of its weight's values (the weight's gradient is the output's gradient
added up by index), so its unit is not gathered for it (`_reads_no_weights`): the input
embedding, the last backward of all, gathers nothing where it would wait for its whole table.

So at most two units are whole at once (the running one and the one being prefetched, or the
two kept for the backward), and at most two units' full gradients (the one filling and the one
being reduced).

It acts on one bucket group (group.py): where a model's experts are a group of their own, each
group's placement hooks the same units and gathers only its own buckets of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from rayzero.sharding.comm import wait
from rayzero.sharding.config import ShardingConfig
from rayzero.sharding.flat_buffer import weak_hook
from rayzero.sharding.layout import Bucket, Layout, Range, build_layout
from rayzero.sharding.memory import nbytes

if TYPE_CHECKING:
    from rayzero.sharding.group import BucketGroup

ROOT = -1  # the unit id of parameters outside every unit


@dataclass(frozen=True)
class Units:
    """Which module is a unit, which unit owns each parameter, which units each hooked module
    needs. Pure bookkeeping over module names; no tensors."""

    modules: tuple[str, ...]  # unit module names, in module order
    owner: dict[str, int]  # parameter name (as named_parameters) -> unit index or ROOT
    users: dict[str, frozenset[int]]  # hooked module name -> units it needs whole to run


def class_names(module: nn.Module) -> set[str]:
    """The names of `module`'s class and of the module classes it derives from: a unit named
    `Embedding` is also the vocabulary-parallel embedding tensor parallelism puts in its place."""
    return {c.__name__ for c in type(module).__mro__ if issubclass(c, nn.Module) and c is not nn.Module}


def find_units(model: nn.Module, classes: tuple[str, ...]) -> Units:
    """Match `classes` against module class names (a class or one it derives from); the
    outermost match wins. Raises a ValueError for a class name that matches no module."""
    names = set().union(*(class_names(m) for m in model.modules()))
    missing = [c for c in classes if c not in names]
    if missing:
        raise ValueError(
            f"sharding.fsdp_units: no module of {type(model).__name__} has class {', '.join(missing)}; "
            f"its module classes are {', '.join(sorted({type(m).__name__ for m in model.modules()}))}"
        )
    unit_modules: list[str] = []
    wanted = set(classes)
    for name, m in model.named_modules():
        inside = any(name.startswith(u + ".") for u in unit_modules)
        if name and class_names(m) & wanted and not inside:
            unit_modules.append(name)
    owner: dict[str, int] = {}
    ident: dict[int, str] = {}  # parameter identity -> its named_parameters name
    for pname, p in model.named_parameters():
        ident[id(p)] = pname
        owner[pname] = next((i for i, u in enumerate(unit_modules) if pname.startswith(u + ".")), ROOT)
    modules = dict(model.named_modules())
    users: dict[str, frozenset[int]] = {}
    for i, u in enumerate(unit_modules):
        users[u] = frozenset(owner[ident[id(p)]] for p in modules[u].parameters()) - {ROOT}
    for name, m in model.named_modules():
        if any(name == u or name.startswith(u + ".") for u in unit_modules):
            continue
        borrowed = {owner[ident[id(p)]] for p in m.parameters(recurse=False)} - {ROOT}
        if borrowed:  # e.g. a tied head outside every unit: it must gather the owner
            users[name] = frozenset(borrowed)
    return Units(tuple(unit_modules), owner, users)


class ShardedUnits:
    """ZeRO-3's placement: a rank keeps its shard of each bucket (one bucket per unit); a unit is
    gathered whole just before it runs and released after, in forward and again in backward (an
    embedding's excepted: its backward reads none of its weight)."""

    whole_at_rest = False

    def __init__(self, g: BucketGroup, model: nn.Module, grad_sync, units: tuple[str, ...]):
        """`grad_sync`: the group's gradient policy, whose landing buckets a unit's backward
        accumulates into in place; `units`: `sharding.fsdp_units`."""
        self.g, self.model, self.grad_sync = g, model, grad_sync
        self.units = find_units(model, units)
        self._shards: dict[int, torch.Tensor] = {}
        self._gathering: dict[int, object] = {}  # bucket index -> pending all-gather work
        self._resident: set[int] = set()
        self._fwd_order: list[str] = []
        self._last_fwd_order: list[str] = list(self.units.users)  # module order, until a forward is seen
        self._ends: frozenset[str] = frozenset()  # the modules that end a forward, once one is seen
        self._bwd_seen: set[str] = set()
        self._recomputed: set[int] = set()  # units a recompute gathered, their backward not run yet
        self._hook()

    @staticmethod
    def layout(model: nn.Module, sharding: ShardingConfig, dp_size: int,
               alone: frozenset[str] = frozenset(), experts: frozenset[str] = frozenset(),
               cpu: bool = False) -> tuple[list, Layout]:
        """One bucket per unit, in forward order: ROOT (-1) first, then units in module order, each
        unit's frozen parameters after its trainable ones (a stable sort keeps the order within
        each), and `alone` ones (a pipeline's tied) in a bucket of their own; a unit's `experts`
        (the expert group's) in a bucket after its dense ones. A unit is one bucket per kind
        whatever its size: it is gathered whole anyway."""
        owner = find_units(model, tuple(sharding.fsdp_units)).owner
        key = {n: (owner[n], n in experts, not p.requires_grad, n in alone) for n, p in model.named_parameters()}
        named = sorted(model.named_parameters(), key=lambda item: key[item[0]])
        return named, build_layout([p.numel() for _, p in named], dp_size, 2**62, sharding.shard_align,
                                   [key[n] for n, _ in named])

    def _hook(self) -> None:
        """Which of the group's buckets each unit has, and the module hooks."""
        buffer = self.g.buffer
        mine = {b.index for b in self.g.buckets}
        # this group's buckets of each unit (trainable, then frozen), and the unit of each
        self._unit_buckets: dict[int, list[int]] = {u: [] for u in (ROOT, *range(len(self.units.modules)))}
        self._bucket_unit: dict[int, int] = {}
        for i, n in enumerate(buffer.names):
            unit, b = self.units.owner[n], buffer.bucket_of(i)
            if b in mine and b not in self._bucket_unit:
                self._bucket_unit[b] = unit
                self._unit_buckets.setdefault(unit, []).append(b)
        self._root = self._unit_buckets[ROOT]
        self._partly_frozen = {u for u, bs in self._unit_buckets.items()
                               if len({buffer.trainable(buffer.buckets[b]) for b in bs}) > 1}
        self._unit_index = {name: k for k, name in enumerate(self.units.modules)}
        modules = dict(self.model.named_modules())
        self._weightless_backward = frozenset(n for n in self.units.users if _reads_no_weights(modules[n]))
        self.model.register_forward_pre_hook(lambda _m, _a: self._pre_model_forward())
        for name in self.units.users:
            modules[name].register_forward_pre_hook(self._make_pre_forward(name))
            modules[name].register_forward_hook(self._make_post_forward(name))

    # -- storage: the shard at rest ------------------------------------------------------
    def hold(self, b: Bucket, category: str) -> None:
        g = self.g
        shard = g.buffer.data[b.index][b.local(g.inner(b))].clone()
        g.ledger.hold(category, nbytes(shard))
        self._shards[b.index] = shard
        g.buffer.release(b)  # materialized one unit at a time: the model is never whole

    def view(self, b: Bucket, r: Range) -> torch.Tensor:
        return self._shards[b.index][r.shift(-self.g.inner(b).start).slice()]

    def whole(self, b: Bucket) -> torch.Tensor:
        """Every rank must call it: the bucket is all-gathered into a new tensor."""
        full = torch.empty(b.world.size, dtype=self._shards[b.index].dtype, device=self.g.buffer.device)
        wait(self.g.axis.start_all_gather(full, self._shards[b.index]))
        return full

    # -- gather and release -------------------------------------------------------------
    def _buckets_of(self, units) -> list[int]:
        return [i for u in units for i in self._unit_buckets[u]]

    def _start_gather(self, units) -> None:
        buffer = self.g.buffer
        for i in self._buckets_of(units):
            if i in self._resident:
                continue
            b = buffer.buckets[i]
            buffer.restore(b)
            self.g.ledger.grow(buffer.nbytes(b))
            self._resident.add(i)
            self._gathering[i] = self.g.axis.start_all_gather(buffer.data[i], self._shards[i])

    def _finish_gather(self, units) -> None:
        self._start_gather(units)
        for i in self._buckets_of(units):
            if i in self._gathering:
                wait(self._gathering.pop(i))

    def _release(self, units, root: bool = False) -> None:
        """Free the gathered parameters of `units` (the root unit's only with `root`)."""
        buffer = self.g.buffer
        for i in self._buckets_of(units):
            if i not in self._resident or (i in self._root and not root):
                continue
            if i in self._gathering:
                wait(self._gathering.pop(i))
            buffer.release(buffer.buckets[i])
            self.g.ledger.shrink(buffer.nbytes(buffer.buckets[i]))
            self._resident.discard(i)

    def _units_of_resident(self) -> set[int]:
        return {self._bucket_unit[i] for i in self._resident}

    # -- hooks ---------------------------------------------------------------------------
    def _pre_model_forward(self) -> None:
        if self._fwd_order:
            self._last_fwd_order = self._fwd_order
            self._ends = frozenset(self._fwd_order[-(2 if self.g.overlap_param_gather else 1):])
        self._fwd_order = []
        self._release(self._units_of_resident())  # what the last forward kept for a backward that did not come
        self._bwd_seen = set()
        if self._root:
            self._finish_gather([ROOT])

    def _neighbour(self, name: str, step: int) -> frozenset[int]:
        """The units the module `step` places after (+1) or before (-1) `name` needs: the
        forward order of the last complete forward (module order before the first)."""
        order = self._last_fwd_order if step > 0 else self._fwd_order
        if name not in order:
            return frozenset()
        k = (len(order) - 1 - order[::-1].index(name)) if step < 0 else order.index(name)
        k += step
        if not 0 <= k < len(order) or step < 0 and order[k] in self._weightless_backward:
            return frozenset()
        return self.units.users[order[k]]

    def _make_pre_forward(self, name: str):
        def hook(_module, _args):
            needs = self.units.users[name]
            if _in_backward():  # activation checkpointing's recompute: gather what it needs, and keep
                self._finish_gather(needs)  # it for the backward that follows (which releases it)
                self._recomputed |= needs
                return
            self._fwd_order.append(name)
            self._finish_gather(needs)
            if self.g.overlap_param_gather:
                self._start_gather(self._neighbour(name, +1))

        return hook

    def _make_post_forward(self, name: str):
        def hook(_module, _args, output):
            if _in_backward():  # a recompute: its backward comes next and releases the unit after
                return
            keep = self._neighbour(name, +1) if self.g.overlap_param_gather else frozenset()
            if self._ends_forward(name):  # its backward comes first: whole until then
                keep |= self.units.users[name]
            self._release(self.units.users[name] - keep)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(name))

        return hook

    def _ends_forward(self, name: str) -> bool:
        """Whether `name` ends a forward with a backward to follow (grad enabled): the last of
        the last forward's order, and with prefetch the one before it too, as many units as are
        whole at once anyway (`_ends`, set as a forward starts). Their units stay whole after
        their forward: the backward starts with them, so releasing them would only gather them
        again at once (torchtitan keeps FSDP2's last block whole the same way). Another forward
        first (a pipeline's next micro-batch) releases them as it starts (`_pre_model_forward`)."""
        return name in self._ends and torch.is_grad_enabled()

    def _make_pre_backward(self, name: str):
        # on an activation, in autograd's C++ state (which a recompute's cache may keep past the step)
        return weak_hook(self, "_pre_backward", name)

    def _pre_backward(self, name: str, _grad=None) -> None:
        if name in self._bwd_seen:
            return
        self._bwd_seen.add(name)
        needs = self.units.users[name]
        ahead = self._neighbour(name, -1) if self.g.overlap_param_gather else frozenset()
        self._recomputed -= needs
        # Units gathered for modules whose backward has run are done with (not those a
        # recompute gathered for a backward still to come).
        self._release(self._units_of_resident() - needs - ahead - self._recomputed)
        if name not in self._weightless_backward:
            self._finish_gather(needs)
        self._start_gather(ahead)
        if name in self._unit_index:
            self._grads_in_place(self._unit_index[name])

    def _grads_in_place(self, unit: int) -> None:
        """Before a unit's backward: its gradient landing buffer, with each of its parameters'
        `.grad` a view into it, so that autograd accumulates there in place instead of
        allocating a gradient per parameter first (when gradients are kept in the parameters'
        dtype). A unit's own parameters only: a weight it borrows (a tied head) gets its
        gradient when the owner's backward comes."""
        g = self.g
        if g.precision.grad != g.precision.param:
            return
        for i in self._unit_buckets[unit]:
            b = g.buffer.buckets[i]
            if not g.buffer.trainable(b) or i in self.grad_sync.reduced:
                continue
            full = self.grad_sync.landing(b)
            for j in b.params:
                p = g.buffer.params[j]
                if p.grad is None:
                    p.grad = full[g.buffer.spans[j]].view(p.shape)

    per_grad = True  # a unit is released once its last gradient is in

    def on_grad(self, i: int, b: Bucket) -> None:
        # The unit's backward is over once its last gradient is in, unless it also holds frozen
        # weights (a LoRA base): the backward to its input may still need them, so it goes when
        # the next unit's backward starts (or the backward ends).
        unit = self.units.owner[self.g.buffer.names[i]]
        if self.g.buffer.pending(b) == 0 and unit not in self._partly_frozen:
            self._release([unit])

    def begin_backward(self) -> None:
        """A backward of its own (a pipeline's micro-batches interleave forwards and backwards):
        each unit's backward hook runs afresh, and the root unit is whole for it."""
        self._bwd_seen = set()
        if self._root:
            self._finish_gather([ROOT])

    def after_backward(self) -> None:
        self._recomputed = set()
        self._release(self._units_of_resident(), root=True)

    def after_forward_only(self) -> None:
        self._release(self._units_of_resident(), root=True)


def _reads_no_weights(module: nn.Module) -> bool:
    """Whether `module`'s backward reads none of its parameters' values: torch's own embedding
    lookup (no subclass's or instance's forward in its place, no `max_norm`, which rewrites rows
    in the forward), whose weight gradient adds the output's gradient up by index and whose
    input (indices) has none."""
    return (type(module).forward is nn.Embedding.forward and "forward" not in vars(module)
            and module.max_norm is None)


def _in_backward() -> bool:
    """Whether a forward runs inside backward (autograd's engine is running a graph task): the
    recompute of activation checkpointing, not the iteration's own forward. Its hooks must not
    record the forward order (the prefetch), register backward hooks again or release what the
    backward about to run needs."""
    return torch._C._current_graph_task_id() != -1


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
