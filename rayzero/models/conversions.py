"""Where each element of a model parameter lies in a checkpoint that transformers' own
`save_pretrained` wrote, when the two layouts differ.

transformers 5 keeps, per architecture, a list of weight transforms
(`get_model_conversion_mapping(model)`): renamings (GPT-NeoX's `embed_out` is the model's
`lm_head`) and converters that build one model parameter from several checkpoint tensors (a
mixture of experts keeps `experts.0.w1.weight` … `experts.7.w3.weight` on disk and one
`experts.gate_up_proj` of shape [experts, 2 x inner, hidden] in the model), applied by
`from_pretrained` and reversed by `save_pretrained`. Here the same transforms, matched to the
checkpoint's keys by transformers' own `rename_source_key`, are turned into a `Part` per
checkpoint tensor: the box of the parameter it fills. A rank then reads, by byte range, just
the elements of its shard from each tensor, never the whole fused parameter; an export cuts
each tensor back out of the parameter, under the name `save_pretrained` gives it.

The converter operations that only move whole slabs of elements can be expressed so:
`MergeModulelist` (stack along a dim), `Concatenate`, `Chunk`, `Split` (and their inverses).
Any other (`Transpose`, `Interleave`, `PermuteForRope`, …) reorders elements inside a tensor;
a model that needs one is refused with its name (`UnsupportedConversion`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from rayzero.models.errors import ModelError


class UnsupportedConversion(ModelError):
    """A weight transform that ranged reads cannot express."""


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's share of a model parameter: a box of the parameter (`param_off`,
    `extent`, per parameter dim) equal to a box of the tensor (`src_off`, per parameter dim, on
    the tensor's dim `src_dims[d]`; None for a dim the tensor lacks, the stacking dim of a
    merged module list)."""

    key: str
    shape: tuple[int, ...]  # the tensor's, in the checkpoint
    param_off: tuple[int, ...]
    src_off: tuple[int, ...]
    extent: tuple[int, ...]
    src_dims: tuple[int | None, ...]

    @classmethod
    def whole(cls, key: str, shape: tuple[int, ...]) -> "Part":
        """A tensor that is the parameter itself (perhaps under another name)."""
        n = len(shape)
        return cls(key, tuple(shape), (0,) * n, (0,) * n, tuple(shape), tuple(range(n)))

    @property
    def numel(self) -> int:
        return math.prod(self.extent)

    def blocks(self, param_shape: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        """(first element in the parameter, first element in the tensor, length) of each run of
        elements contiguous in both, in the parameter's order."""
        r = len(param_shape)
        src_shape = self.shape
        # The last dim where the box is not whole, in the parameter or in the tensor: the dims
        # after it are whole in both, so one run spans them.
        k = -1
        for d in range(r):
            sd = self.src_dims[d]
            if self.extent[d] != param_shape[d] or (sd is not None and self.extent[d] != src_shape[sd]):
                k = d
        if k < r - 1 and [self.src_dims[d] for d in range(k + 1, r)] != list(range(len(src_shape) - (r - 1 - k),
                                                                                    len(src_shape))):
            raise UnsupportedConversion(f"{self.key}: its dims are in another order than the parameter's")
        pstride = _strides(param_shape)
        sstride = _strides(src_shape)
        tail = math.prod(param_shape[k + 1:]) if k < r - 1 else 1
        length = (self.extent[k] if k >= 0 else 1) * tail
        outer = [range(self.extent[d]) for d in range(k)]
        for idx in _product(outer):
            p = sum((self.param_off[d] + i) * pstride[d] for d, i in enumerate(idx))
            s = sum((self.src_off[d] + i) * sstride[self.src_dims[d]] for d, i in enumerate(idx)
                    if self.src_dims[d] is not None)
            if k >= 0:
                p += self.param_off[k] * pstride[k]
                if self.src_dims[k] is not None:
                    s += self.src_off[k] * sstride[self.src_dims[k]]
            yield p, s, length

    def runs(self, param_shape: tuple[int, ...], start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """Elements [start, end) of the parameter that this tensor holds, as (first element in
        the tensor, length, offset from `start`)."""
        for p, s, n in self.blocks(param_shape):
            lo, hi = max(p, start), min(p + n, end)
            if lo < hi:
                yield s + lo - p, hi - lo, lo - start
            elif p >= end:
                return


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d], acc = acc, acc * shape[d]
    return out


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


# -- what a converter's operations do to the boxes ---------------------------------------------

@dataclass
class _Slab:
    """An intermediate tensor of a converter's chain: its shape and the parts that fill it."""

    shape: tuple[int, ...]
    parts: list[Part]


def _stack(slabs: list[_Slab], dim: int) -> _Slab:
    shape = slabs[0].shape
    if any(s.shape != shape for s in slabs):
        raise ModelError(f"tensors of different shapes ({sorted({s.shape for s in slabs})}) to stack")
    parts = [replace(p, param_off=_ins(p.param_off, dim, i), src_off=_ins(p.src_off, dim, 0),
                     extent=_ins(p.extent, dim, 1), src_dims=_ins(p.src_dims, dim, None))
             for i, s in enumerate(slabs) for p in s.parts]
    return _Slab(_ins(shape, dim, len(slabs)), parts)


def _concatenate(slabs: list[_Slab], dim: int) -> _Slab:
    parts, at = [], 0
    for s in slabs:
        parts += [replace(p, param_off=_add(p.param_off, dim, at)) for p in s.parts]
        at += s.shape[dim]
    shape = list(slabs[0].shape)
    shape[dim] = at
    return _Slab(tuple(shape), parts)


def _cut(slab: _Slab, dim: int, sizes: list[int]) -> list[_Slab]:
    """`slab` split along `dim` into pieces of `sizes`: the parts that overlap each, clipped."""
    out, at = [], 0
    for size in sizes:
        parts = []
        for p in slab.parts:
            lo, hi = max(p.param_off[dim], at), min(p.param_off[dim] + p.extent[dim], at + size)
            if lo >= hi:
                continue
            shift = lo - p.param_off[dim]
            parts.append(replace(p, param_off=_set(p.param_off, dim, lo - at),
                                 src_off=_add(p.src_off, dim, shift) if p.src_dims[dim] is not None else p.src_off,
                                 extent=_set(p.extent, dim, hi - lo)))
        shape = list(slab.shape)
        shape[dim] = size
        out.append(_Slab(tuple(shape), parts))
        at += size
    return out


def _ins(t: tuple, dim: int, value) -> tuple:
    return (*t[:dim], value, *t[dim:])


def _set(t: tuple, dim: int, value) -> tuple:
    return (*t[:dim], value, *t[dim + 1:])


def _add(t: tuple, dim: int, value: int) -> tuple:
    return _set(t, dim, t[dim] + value)


def convert(converter, sources: dict[str, list[tuple[str, tuple[int, ...]]]], targets: dict[str, tuple[int, ...]]
            ) -> dict[str, list[Part]]:
    """The parts of each target of one converter group: `sources` maps each of its source
    patterns to the checkpoint tensors it collected (key, shape), in transformers' order;
    `targets`, each target pattern to the shape of the model parameter it names."""
    from transformers.core_model_loading import (
        Chunk, Concatenate, MergeModulelist, Split, SplitModulelist,
    )

    state = {pat: [_Slab(tuple(shape), [Part.whole(key, shape)]) for key, shape in sources[pat]]
             for pat in converter.source_patterns if pat in sources}
    target_patterns = list(converter.target_patterns)
    for op in converter.operations:
        name = type(op).__name__
        if isinstance(op, MergeModulelist):
            merged = {pat: [_stack(slabs, op.dim)] for pat, slabs in state.items()}
            state = merged if len(merged) > 1 else {target_patterns[0]: next(iter(merged.values()))}
        elif isinstance(op, Concatenate):
            slabs = [s for pat in converter.source_patterns if pat in state for s in state[pat]]
            state = {target_patterns[0]: [_concatenate(slabs, op.dim)]}
        elif isinstance(op, (Chunk, Split, SplitModulelist)):
            (slabs,) = state.values()
            (slab,) = slabs
            if isinstance(op, Split):
                sizes = [targets[t][op.dim] for t in target_patterns]
            elif isinstance(op, Chunk):
                n = len(target_patterns)
                if slab.shape[op.dim] % n:
                    raise UnsupportedConversion(f"Chunk(dim={op.dim}) of a dim of {slab.shape[op.dim]} into {n}")
                sizes = [slab.shape[op.dim] // n] * n
            else:
                sizes = [1] * slab.shape[op.dim]
            pieces = _cut(slab, op.dim, sizes)
            if isinstance(op, SplitModulelist):  # each piece loses the split dim
                pieces = [_Slab(_drop(p.shape, op.dim), [_squeeze(q, op.dim) for q in p.parts]) for p in pieces]
                state = {target_patterns[0].replace("*", str(i)): [p] for i, p in enumerate(pieces)}
            else:
                state = {t: [p] for t, p in zip(target_patterns, pieces)}
        else:
            raise UnsupportedConversion(f"the weight conversion {name} (in {converter}) reorders elements within a "
                                        "tensor, which ranged reads cannot follow")
    out = {}
    for pat, slabs in state.items():
        (slab,) = slabs
        want = targets.get(pat)
        if want is not None and tuple(want) != slab.shape:
            raise ModelError(f"{pat}: the checkpoint's tensors make shape {list(slab.shape)}, the model's parameter is "
                             f"{list(want)}")
        out[pat] = slab.parts
    return out


def _drop(t: tuple, dim: int) -> tuple:
    return (*t[:dim], *t[dim + 1:])


def _squeeze(p: Part, dim: int) -> Part:
    return replace(p, param_off=_drop(p.param_off, dim), src_off=_drop(p.src_off, dim), extent=_drop(p.extent, dim),
                   src_dims=_drop(p.src_dims, dim))


# -- the whole model ------------------------------------------------------------------------------

@dataclass
class Layout:
    """Each parameter's parts, and the checkpoint tensors no parameter takes."""

    parts: dict[str, list[Part]]
    unused: list[str]


def transforms_of(model) -> list:
    """The weight transforms transformers applies to `model` when loading (class name first,
    then `model_type`, sub-models scoped), the same list PEFT uses."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model)


def load_layout(model, keys: dict[str, tuple[int, ...]], params: dict[str, tuple[int, ...]],
                transforms: list | None = None) -> Layout:
    """Which checkpoint tensors (`keys`: name -> shape) fill which parameters (`params`),
    matched as `from_pretrained` matches them: each key renamed by every matching renaming,
    then at most one converter, with the model's base prefix added or taken away."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = transforms_of(model) if transforms is None else transforms
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = {**{n: True for n in params}, **{n: True for n, _ in model.named_buffers()}}
    prefix = getattr(model, "base_model_prefix", None) or None
    parts: dict[str, list[Part]] = {}
    groups: dict[str, tuple[object, dict[str, list]]] = {}
    unused = []
    for key in sorted(keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if renamed not in known and key in known:
            renamed, pattern = key, None
        if renamed not in params:
            unused.append(key)
            continue
        if pattern is None:
            parts[renamed] = [Part.whole(key, keys[key])]
            continue
        group = groups.setdefault(renamed, (by_pattern[pattern], {}))
        group[1].setdefault(pattern, []).append((key, keys[key]))
    for first, (converter, sources) in groups.items():
        names = _target_names(first, converter)
        targets = {pat: params[name] for pat, name in names.items() if name in params}
        try:
            converted = convert(converter, sources, targets)
        except UnsupportedConversion as e:
            raise UnsupportedConversion(f"{first}: {e}") from None
        for pat, group_parts in converted.items():
            parts[names.get(pat, first)] = group_parts
    return Layout(parts, unused)


def _target_names(first: str, converter) -> dict[str, str]:
    """The full parameter name of each of a converter's target patterns, given the name the
    first one took (transformers: the prefix and suffix around the pattern carry over)."""
    for pat in converter.target_patterns:
        plain = pat.replace("*.", "0.")
        if plain in first:
            head, _, tail = first.partition(plain)
            return {t: head + t + tail for t in converter.target_patterns}
    return {converter.target_patterns[0]: first}


def saved_keys(model, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensors `save_pretrained` writes for these parameters (name -> shape), from
    transformers' own reversed transforms run on shapes alone (meta tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    meta = {n: torch.empty(shape, device="meta") for n, shape in params.items()}
    return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, meta).items()}
