"""Megatron-style tensor parallelism on local shards: column-parallel then row-parallel linears.

In an attention block the query/key/value projections are column-parallel (each rank computes
its own heads), the output projection row-parallel (each rank multiplies its heads' part of
the input and the partial outputs are summed); in the MLP the up (and gate) projections are
column-parallel and the down projection row-parallel. The communication, Megatron's "f" and
"g" and their sequence-parallel forms, is in `rayzero.sharding.tp_comm`; a block costs two
all-reduces of (batch, seq, hidden) in forward and two in backward. With sequence parallelism (Megatron's, `sequence_parallel=True`) the
activations between the tensor-parallel regions are split along the sequence over the TP
ranks, so the norms, the residual adds and dropout run on a rank's sequence shard; the first
block's input is split and the final norm's output gathered, so the embeddings, the replicated
head and the loss see the whole sequence. The norms and the row-parallel biases then see a part
of the tokens each: their gradients are summed over the TP group (`TPLayout.partial`).

Why our own layers rather than DTensor: the strategies keep every parameter as a plain view
into a flat bucket (`FlatBuffer.install`), which suits a layer whose parameter *is* the local
shard; a DTensor parameter would have to be unwrapped into that buffer and rewrapped around
every use. The layers below subclass `nn.Linear`, keep its parameter names (`weight`, `bias`)
and differ only in `forward`, so checkpoints, exports and PEFT see the model's own names.

The input embedding and the output head are split over the vocabulary, one parameter where
they are tied (`rayzero.sharding.vocab_parallel`: Megatron's vocabulary-parallel embedding,
column-parallel head and cross-entropy on the logit shards), where the model's are the plain
layers; otherwise (`TPLayout.vocab_note` says why) and with `parallel.vocab_parallel=false` they
stay replicated, with the full logits on every TP rank. Norms stay replicated: their inputs are
the same on every rank (the row-parallel outputs are all-reduced), so are their gradients; the
strategies shard the replicated parameters over the data-parallel ranks.

Dropout draws from streams the layers switch at the regions' boundaries (`rayzero.sharding.rng`):
a rank's own inside a split region, one common to the TP group outside it.

Key/value heads fewer than the TP ranks (grouped-query attention with few kv heads) are
replicated: each rank holds the whole projection and computes only the kv heads its query
heads attend with. Its gradient then holds only those heads' rows, a part of the whole: it is
summed over the TP group after backward (`TPLayout.partial`).

Pure torch (no Ray): `parallelize` works on a model on the meta device, before a strategy.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from rayzero.sharding.comm import Axis
from rayzero.sharding.flat_buffer import ParamSource, Piece
from rayzero.sharding.rng import RandomStreams
from rayzero.sharding.tp_comm import TPComm, split_sequence, whole_sequence
from rayzero.sharding.vocab_parallel import VocabShard, split_embedding, split_head, why_not_split


class TPError(ValueError):
    """A tensor-parallel size the model's shapes cannot be split by."""


# -- where each parameter's elements come from ------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """A parameter split over the TP group along `dim` (0: output rows, column-parallel; 1:
    input columns, row-parallel). With `parts` > 1 the tensor is several fused along `dim`
    (the GPT's q|k|v) and each part is split on its own, so a rank holds its heads of each.
    `padded` (dim 0, a vocabulary): each rank holds ceil(rows / tp) rows, the last rank's last
    ones padding that no global element maps to."""

    dim: int
    parts: int = 1
    padded: bool = False
    axis: str = "tp"  # the mesh role it splits over: "tp", or "ep" (a mixture of experts' experts, dim 0)

    def local_rows(self, rows: int, tp: int) -> int:
        """A rank's share of `rows` (one part's)."""
        return -(-rows // tp) if self.padded else rows // tp

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = self.parts * self.local_rows(shape[self.dim] // self.parts, tp)
        return tuple(out)

    def runs(self, shape: tuple[int, ...], tp: int, tp_rank: int) -> list[tuple[int, int, int]]:
        """Where the local tensor's elements sit in the global one, as contiguous runs
        (local flat start, global flat start, length), in local order; padding is in none."""
        if self.dim == 0:
            row = math.prod(shape[1:])
            part_rows = shape[0] // self.parts
            local_rows = self.local_rows(part_rows, tp)
            real = max(0, min(local_rows, part_rows - tp_rank * local_rows))
            return [(p * local_rows * row, (p * part_rows + tp_rank * local_rows) * row, real * row)
                    for p in range(self.parts) if real]
        rows, cols = shape[0], math.prod(shape[1:])  # dim 1 of a matrix: each row a run
        local_cols = cols // tp
        return [(r * local_cols, r * cols + tp_rank * local_cols, local_cols) for r in range(rows)]

    def record(self) -> dict:
        return {"dim": self.dim, "parts": self.parts, **({"padded": True} if self.padded else {}),
                **({"axis": self.axis} if self.axis != "tp" else {})}

    @classmethod
    def from_record(cls, placed: dict) -> "Split":
        return cls(placed["dim"], placed["parts"], placed.get("padded", False), placed.get("axis", "tp"))


@dataclass
class TPLayout:
    """What `parallelize` did: per split parameter its placement and global shape; the
    replicated parameters whose gradient is a partial sum over the TP group; the vocabulary
    shard when the embedding and head are split (`vocab_parallel`), else why they are not.
    Expert parallelism adds its experts' tensors (split along dim 0 over the `ep` role)."""

    size: int
    rank: int
    split: dict[str, Split] = field(default_factory=dict)
    global_shape: dict[str, tuple[int, ...]] = field(default_factory=dict)
    partial: set[str] = field(default_factory=set)
    vocab: VocabShard | None = None
    vocab_note: str | None = None  # why the vocabulary stays whole on every TP rank
    ep: tuple[int, int] = (1, 0)  # expert parallelism's group: (size, this rank's place)

    def place(self, split: Split) -> tuple[int, int]:
        """(group size, this rank's place in it) of the role `split` splits over."""
        return self.ep if split.axis == "ep" else (self.size, self.rank)

    def split_numel(self) -> int:
        """Elements of the split parameters that the other TP (and ep) ranks hold (whole model - this rank's)."""
        return sum(math.prod(g) - math.prod(self.split[n].local_shape(g, self.place(self.split[n])[0]))
                   for n, g in self.global_shape.items())

    def record(self) -> dict:
        """The manifest's note: each split tensor's global shape and placement."""
        return {"tp": self.size, **({"ep": self.ep[0]} if self.ep[0] > 1 else {}),
                "split": {n: {**s.record(), "global_shape": list(self.global_shape[n])}
                          for n, s in sorted(self.split.items())},
                "replicated_partial_grad": sorted(self.partial),
                "vocab_parallel": self.vocab is not None}


# -- the layers --------------------------------------------------------------------------------------

class _SharedInput:
    """One "f" for all the column-parallel linears of a module: a pre-hook passes the module
    f(input) instead of its input (with sequence parallelism, the gathered sequence, so the
    module, attention included, sees the whole sequence); a linear given that tensor uses it
    as it is, any other input gets an "f" of its own (so a module that feeds its linears
    something else is still right, only less frugal)."""

    def __init__(self, module: nn.Module, comm: TPComm):
        self.comm = comm
        self.copy: torch.Tensor | None = None
        module.register_forward_pre_hook(self._before, with_kwargs=True)
        module.register_forward_hook(self._after)

    def _before(self, _module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            self.copy = self.comm.into_columns(args[0])
            return (self.copy, *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else "x"
        if isinstance(kwargs.get(key), torch.Tensor):
            self.copy = self.comm.into_columns(kwargs[key])
            return args, {**kwargs, key: self.copy}
        return None

    def _after(self, *_):
        self.copy = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if x is self.copy else self.comm.into_columns(x)


def _into_columns(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel layer's input: the module's shared "f", its own, or (`comm` None: a
    LoRA B, whose input A computed after the transition) none."""
    if layer.shared is not None:
        return layer.shared(x)
    return x if layer.comm is None else layer.comm.into_columns(x)


class ColumnParallelLinear(nn.Linear):
    """y_local = f(x) W_local^T + b_local: this rank's share of the output features."""

    comm: TPComm | None
    shared: _SharedInput | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_into_columns(self, x), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """y = g(x_local W_local^T) + b: the partial products over this rank's input features,
    summed over the group; the bias (replicated) added once, after the sum."""

    comm: TPComm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.out_of_rows(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class HeadSelectLinear(nn.Linear):
    """A key or value projection with fewer heads than TP ranks: the whole (replicated) weight,
    of which this rank computes the rows of the one head its query heads use."""

    comm: TPComm | None
    rows: slice
    shared: _SharedInput | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.rows]
        return F.linear(_into_columns(self, x), self.weight[self.rows], bias)


def _swap(linear: nn.Linear, cls: type, in_features: int, out_features: int, comm: TPComm) -> nn.Linear:
    """`cls` in place of `linear`, with parameters of the new shape on the meta device and
    the same trainability."""
    new = cls(in_features, out_features, bias=linear.bias is not None, device="meta", dtype=linear.weight.dtype)
    new.comm = comm
    for name in ("weight", "bias"):
        old = getattr(linear, name)
        if old is not None:
            getattr(new, name).requires_grad_(old.requires_grad)
    return new


# -- applying a plan ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Style:
    """How one linear is split. `column` over `parts` fused outputs, or `row`. A column split
    of attention heads names how many heads the output holds (`heads`, per part); key/value
    heads (`kv`) fewer than the TP ranks, and dividing them, are replicated instead, each rank
    computing the one its query heads use."""

    kind: str  # "column" or "row"
    parts: int = 1
    heads: int | None = None
    kv: bool = False


def parallelize(model: nn.Module, plan: dict[str, Style], axis: Axis, sequence: tuple[str, str] | None = None,
                vocab: tuple[str | None, str | None] | None = None, streams: RandomStreams | None = None) -> TPLayout:
    """Swap the linears named in `plan` (module-name patterns, `*` for one name part) for
    their tensor-parallel versions over `axis`. TPError naming the layer and the sizes when a
    shape does not divide; the patterns must each match a linear. `sequence`: (the first
    block, the final norm) for sequence parallelism between them. `vocab`: (the input
    embedding, the output head) to split over the vocabulary (`vocab_parallel`), where they can
    be (else `vocab_note` says why not). `streams`: the rank's dropout streams, switched at the
    regions' boundaries (`rng`): a split region (from a column-parallel output to the end of the
    row-parallel layer after it) draws from its TP rank's stream, the rest from the stream its
    activations call for (replicated, or the sequence shard's)."""
    tp, rank = axis.size, axis.rank
    layout = TPLayout(tp, rank)
    comm = TPComm(axis, sequence is not None)
    modules = dict(model.named_modules())
    shared: dict[str, _SharedInput] = {}
    outside = "sequence" if sequence is not None else "replicated"  # the stream between split regions
    for pattern, style in plan.items():
        names = [n for n in modules if matches(pattern, n)]
        if not names:
            raise TPError(f"the tensor-parallel plan names {pattern!r}, which matches no module of "
                          f"{type(model).__name__}")
        for name in names:
            parent, _, attr = name.rpartition(".")
            owner = modules[parent] if parent else model
            share = None
            if style.kind == "column" and tp > 1 and owner is not model:  # one "f" per module input
                if parent not in shared:
                    shared[parent] = _SharedInput(owner, comm)
                share = shared[parent]
            target = modules[name]
            if _is_adapted(target):
                _split_adapted(name, target, style, comm, layout, share, streams)
                placed = target
            elif isinstance(target, nn.Linear):
                placed = _split_linear(name, target, style, comm, layout)
                placed.shared = share if style.kind == "column" else None
                setattr(owner, attr, placed)
            else:
                raise TPError(f"{name}: the tensor-parallel plan splits linear layers, and this is a "
                              f"{type(target).__name__}")
            if streams is not None and tp > 1:
                region = "tp" if style.kind == "column" else outside  # what the layer's output feeds
                placed.register_forward_hook(lambda *_, region=region: streams.enter(region))
    if vocab is not None and tp > 1:
        _split_vocabulary(model, modules, vocab, axis, layout)
    if sequence is not None and tp > 1:
        _sequence_parallel(model, modules, sequence, axis, layout, streams)
    return layout


def _split_vocabulary(model: nn.Module, modules: dict, ends: tuple[str | None, str | None], axis: Axis,
                      layout: TPLayout) -> None:
    """The input embedding and the output head split over the vocabulary's rows, one parameter
    where they are tied (`vocab_parallel`); left whole, with the reason in `layout.vocab_note`,
    where they cannot be."""
    emb_name, head_name = ends
    embedding, head = modules.get(emb_name) if emb_name else None, modules.get(head_name) if head_name else None
    problem = why_not_split(embedding, head)
    if problem is not None:
        layout.vocab_note = problem
        return
    if axis.size > embedding.num_embeddings:
        raise TPError(f"parallel.tp={axis.size} exceeds the vocabulary ({embedding.num_embeddings} tokens) that the "
                      "embedding and head are split over; use a smaller parallel.tp, or parallel.vocab_parallel=false")
    shard = VocabShard(axis, embedding.num_embeddings)
    tied = head.weight is embedding.weight
    new_emb = split_embedding(embedding, shard)
    new_head = split_head(head, shard, new_emb.weight if tied else None)
    for name, new in ((emb_name, new_emb), (head_name, new_head)):
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent] if parent else model, attr, new)
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight: by its one name
    whole = {new_emb.weight: embedding.weight.shape, new_head.weight: head.weight.shape}
    if head.bias is not None:
        whole[new_head.bias] = head.bias.shape
    for p, shape in whole.items():
        layout.split[names[id(p)]] = Split(0, padded=True)
        layout.global_shape[names[id(p)]] = tuple(shape)
    layout.vocab = shard


def _sequence_parallel(model: nn.Module, modules: dict, ends: tuple[str, str], axis: Axis, layout: TPLayout,
                       streams: RandomStreams | None = None) -> None:
    """Split the sequence at the first block's input, gather it at the final norm's output;
    every replicated parameter in between (norms, row-parallel biases, LoRA's unsplit halves)
    sees a part of the tokens: its gradient is a partial sum. Dropout in between draws from the
    sequence shard's stream."""
    first, last = ends
    for name in ends:
        if name not in modules:
            raise TPError(f"sequence parallelism: {type(model).__name__} has no module {name!r}")

    def split_input(_module, args, kwargs):
        if streams is not None:
            streams.enter("sequence")
        if args:
            return (split_sequence(args[0], axis), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else "x"
        return args, {**kwargs, key: split_sequence(kwargs[key], axis)}

    def gather_output(_module, _args, out):
        if streams is not None:
            streams.enter("replicated")
        return whole_sequence(out, axis)

    modules[first].register_forward_pre_hook(split_input, with_kwargs=True)
    modules[last].register_forward_hook(gather_output)
    block_prefix = first.rpartition(".")[0] + "."  # every block: the list the first one is in
    for name, _ in model.named_parameters():
        inside = name.startswith(block_prefix) or name.startswith(last + ".")
        if inside and name not in layout.split:
            layout.partial.add(name)


def _is_adapted(module: nn.Module) -> bool:
    """A linear wrapped with low-rank adapters, as PEFT's LoRA layers are: `base_layer` and the
    `lora_A` / `lora_B` dictionaries of linears."""
    return isinstance(getattr(module, "base_layer", None), nn.Linear) and hasattr(module, "lora_A")


def _split_adapted(name: str, wrapper: nn.Module, style: Style, comm: TPComm, layout: TPLayout,
                   share: _SharedInput | None, streams: RandomStreams | None = None) -> None:
    """A LoRA layer split to match its base: column-parallel, B splits its outputs as the base
    does and A stays whole, taking the base's input transition (its gradient a partial sum over
    the TP ranks); row-parallel, A splits its inputs as the base does (its partial products
    summed, "g") and B stays whole. The adapters' dropout on a column-parallel layer's input
    (the same on every TP rank) draws alike on every rank; on a row-parallel one's (a rank's
    split features), from the rank's own stream."""
    base = _split_linear(name, wrapper.base_layer, style, comm, layout)
    base.shared = share if style.kind == "column" else None
    wrapper.base_layer = base
    for attr, p in base._parameters.items():  # the model's own names (`q_proj.weight`) alias the base's
        if attr in wrapper._parameters:
            wrapper._parameters[attr] = p
    for key in list(wrapper.lora_A.keys()):
        if style.kind == "column":
            # A (whole) takes the base's input transition, B splits its outputs as the base does
            # and needs none; A's gradient is then each rank's part of the sum over B's shards
            a = wrapper.lora_A[key]
            wrapper.lora_A[key] = _swap(a, ColumnParallelLinear, a.in_features, a.out_features, comm)
            wrapper.lora_A[key].shared = share
            layout.partial |= {f"{name}.lora_A.{key}.{p}" for p, _ in wrapper.lora_A[key].named_parameters()}
            wrapper.lora_B[key] = _split_linear(f"{name}.lora_B.{key}", wrapper.lora_B[key], style, None, layout,
                                                comm.axis)
            if streams is not None and key in getattr(wrapper, "lora_dropout", {}):
                _draw_in(wrapper.lora_dropout[key], streams, "replicated")
        else:
            wrapper.lora_A[key] = _split_linear(f"{name}.lora_A.{key}", wrapper.lora_A[key], style, comm, layout)


def _draw_in(module: nn.Module, streams: RandomStreams, region: str) -> None:
    """`module`'s forward draws from `region`'s stream, whatever stream is active around it."""
    open_regions: list = []

    def enter(*_):
        open_regions.append(streams.region(region))
        open_regions[-1].__enter__()

    def leave(*_):
        open_regions.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _split_linear(name: str, linear: nn.Linear, style: Style, comm: TPComm | None, layout: TPLayout,
                  axis: Axis | None = None) -> nn.Linear:
    """`linear`'s tensor-parallel version; `comm` None (with the group's `axis`): a column split
    with no input transition."""
    axis = comm.axis if comm is not None else axis
    tp, rank = axis.size, axis.rank
    out_f, in_f = linear.out_features, linear.in_features
    if style.kind == "row":
        if in_f % tp:
            raise TPError(f"{name}: parallel.tp={tp} does not divide its {in_f} input features")
        layout.split[f"{name}.weight"] = Split(1)
        layout.global_shape[f"{name}.weight"] = (out_f, in_f)
        return _swap(linear, RowParallelLinear, in_f // tp, out_f, comm)
    if style.heads is not None and style.heads % tp:
        if not style.kv:
            raise TPError(f"{name}: parallel.tp={tp} does not divide its {style.heads} attention heads")
        if tp % style.heads:
            raise TPError(f"{name}: parallel.tp={tp} neither divides its {style.heads} key/value heads nor is a "
                          f"multiple of them (each would be replicated on tp / heads ranks)")
        new = _swap(linear, HeadSelectLinear, in_f, out_f, comm)
        head_dim = out_f // style.heads
        h = rank * style.heads // tp  # the key/value head of this rank's query heads
        new.rows = slice(h * head_dim, (h + 1) * head_dim)
        layout.partial |= {f"{name}.{p}" for p, _ in new.named_parameters()}
        return new
    if out_f % (style.parts * tp):
        what = f"{out_f} output features" + (f" ({style.parts} fused parts)" if style.parts > 1 else "")
        raise TPError(f"{name}: parallel.tp={tp} does not divide its {what}")
    for p in ("weight", "bias"):
        t = getattr(linear, p)
        if t is not None:
            layout.split[f"{name}.{p}"] = Split(0, style.parts)
            layout.global_shape[f"{name}.{p}"] = tuple(t.shape)
    return _swap(linear, ColumnParallelLinear, in_f, out_f // tp, comm)


def matches(pattern: str, name: str) -> bool:
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


# -- initial values: each rank its slice of the global tensor ----------------------------------------

class TPSlices(ParamSource):
    """A source of global tensors seen through a TP layout: a split parameter's local
    elements are read as the ranges of the global tensor they are (whole rows of it; for a
    row-parallel weight, a run per row), so pretrained weights are read by range, never whole."""

    def __init__(self, inner: ParamSource, layout: TPLayout):
        self.inner, self.layout = inner, layout
        self.partial = inner.partial

    def fill(self, name: str, out: torch.Tensor) -> None:
        if name not in self.layout.split:
            self.inner.fill(name, out)
            return
        self.fill_pieces([Piece(name, 0, out.numel(), tuple(out.shape), out.view(-1))])

    def fill_pieces(self, pieces: list[Piece]) -> None:
        mapped = []
        for p in pieces:
            split = self.layout.split.get(p.name)
            if split is None:
                mapped.append(p)
                continue
            shape = self.layout.global_shape[p.name]
            if split.padded:  # rows past the vocabulary: no global element, zero
                p.out.zero_()
            for local, glob, n in split.runs(shape, *self.layout.place(split)):
                lo, hi = max(p.start, local), min(p.end, local + n)
                if lo < hi:
                    mapped.append(Piece(p.name, glob + lo - local, glob + hi - local, shape,
                                        p.out[lo - p.start: hi - p.start]))
        self.inner.fill_pieces(mapped)

    @property
    def bytes_read(self):
        return getattr(self.inner, "bytes_read", None)


def gather_global(name: str, local: torch.Tensor, layout: TPLayout, axis: Axis) -> torch.Tensor:
    """The global tensor of a split parameter from every TP rank's `local` (all must call)."""
    split = layout.split[name]
    pieces = [torch.empty_like(local) for _ in range(axis.size)]
    dist.all_gather(pieces, local.contiguous(), group=axis.group)
    if split.dim == 1:
        return torch.cat(pieces, dim=1)
    parts = [p.chunk(split.parts, dim=0) for p in pieces]
    part_rows = layout.global_shape[name][0] // split.parts  # a padded split's padding is each part's tail
    return torch.cat([torch.cat([parts[r][k] for r in range(axis.size)])[:part_rows] for k in range(split.parts)])

