"""Pipeline stages: the model's blocks cut into runs, one run per stage, and a rank's model made
of its stages only.

The blocks are the model's repeated layers, the same modules activation checkpointing recomputes
and ZeRO-3 makes units of (`spec.stage_blocks`). The modules with parameters outside them are the
model's ends: those before the first block in module order (the embeddings) belong to the first
stage, those after the last (the final norm, the head) to the last one:

    GPT, 4 blocks, pp 2:     stage 0: wte, wpe, blocks.0, blocks.1
                             stage 1: blocks.2, blocks.3, ln_f, lm_head (= wte.weight, tied)

With `pp_virtual_stages` v > 1 there are pp x v stages and rank r holds stages r, r + pp, …
(`schedules.stage_of`). Stages are balanced by parameter count (the ends counted to their
stage) unless `parallel.pp_layers` sets the counts; interleaving splits the blocks evenly.

A rank's model keeps the model's class, forward and names: a block it does not hold becomes a
`Passthrough` (its input out), an end it does not hold a `Passthrough` or, at the input, an
`Absent` embedding (zeros of the hidden width); the stage's first block takes the activations
received from the stage before, and its last block's output ends the forward
(`StageRunner`). An end that shares a parameter with a module the stage holds stays (a tied
embedding on the last stage: its weight is the head's), swapped for its `Absent` while the
stage runs, so the tied weight keeps its one name on both stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from rayzero.pipeline.schedules import stage_of


class PipelineError(ValueError):
    """Sizes or a split that cannot make the pipeline, said in the config's terms."""


class Passthrough(nn.Module):
    """A block (or an end after the blocks) another stage holds: its first input out."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


class Absent(nn.Module):
    """An input embedding another stage holds: zeros of its width, for the token ids given (the
    stage's first block takes the received activations in their place)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.dtype = torch.float32  # the compute dtype, set once the strategy has chosen it

    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


# -- the split ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class StagePlan:
    """Which modules each stage holds: `counts[s]` consecutive blocks for stage s, the first
    stage's ends and the last's."""

    pp: int
    virtual: int
    blocks: tuple[str, ...]
    counts: tuple[int, ...]
    first: tuple[str, ...]  # ends before the blocks: the first stage's
    last: tuple[str, ...]  # ends after them: the last stage's

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def stage_blocks(self, s: int) -> tuple[str, ...]:
        start = sum(self.counts[:s])
        return self.blocks[start:start + self.counts[s]]

    def modules(self, s: int) -> tuple[str, ...]:
        """The modules stage `s` holds, in model order."""
        return ((self.first if s == 0 else ()) + self.stage_blocks(s)
                + (self.last if s == self.num_stages - 1 else ()))

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages rank `pp_rank` of the pipeline holds, one per model chunk."""
        return [stage_of(pp_rank, c, self.pp) for c in range(self.virtual)]

    def describe(self) -> list[str]:
        """Each stage's modules in words: blocks as a range."""
        out = []
        for s in range(self.num_stages):
            blocks = self.stage_blocks(s)
            span = blocks[0] if len(blocks) == 1 else f"{blocks[0]} … {blocks[-1]} ({len(blocks)} blocks)"
            ends = (self.first if s == 0 else ()), (self.last if s == self.num_stages - 1 else ())
            out.append(", ".join([*ends[0], span, *ends[1]]))
        return out


def ends(model: nn.Module, blocks: list[str]) -> tuple[list[str], list[str]]:
    """The outermost modules with parameters outside every block, split at the first block in
    module order: (before, after)."""
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    chosen: list[str] = []
    for name, m in model.named_modules():
        if not name or any(name == b or name.startswith(b + ".") or b.startswith(name + ".") for b in blocks):
            continue
        if any(name.startswith(c + ".") for c in chosen) or next(m.parameters(), None) is None:
            continue
        chosen.append(name)
    first = order[blocks[0]]
    return [c for c in chosen if order[c] < first], [c for c in chosen if order[c] > first]


def balanced(weights: list[int], parts: int) -> list[int]:
    """Counts of consecutive items per part that minimize the heaviest part (linear partition)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest part splitting the first i items into k parts; cut[k][i]: the last cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def plan_stages(model: nn.Module, blocks: list[str], pp: int, virtual: int = 1,
                layers: list[int] | None = None) -> StagePlan:
    """The split of `model` (on any device) into pp x virtual stages; PipelineError for sizes
    that cannot make it."""
    stages = pp * virtual
    if stages > len(blocks):
        raise PipelineError(f"parallel.pp: {stages} stages" + (f" (parallel.pp {pp} x parallel.pp_virtual_stages "
                            f"{virtual})" if virtual > 1 else "") + f" but the model has {len(blocks)} blocks; "
                            "each stage needs at least one")
    first, last = ends(model, blocks)
    modules = dict(model.named_modules())
    if layers is not None:
        if sum(layers) != len(blocks):
            raise PipelineError(f"parallel.pp_layers: {list(layers)} sum to {sum(layers)}, but the model has "
                                f"{len(blocks)} blocks")
        counts = list(layers)
    elif virtual > 1:
        if len(blocks) % stages:
            raise PipelineError(f"parallel.pp_schedule: interleaved_1f1b splits the {len(blocks)} blocks evenly "
                                f"over parallel.pp x parallel.pp_virtual_stages = {stages} stages, which does not "
                                "divide them; change either or set parallel.pp_layers")
        counts = [len(blocks) // stages] * stages
    else:
        weights = [numel(modules[b]) for b in blocks]
        weights[0] += sum(numel(modules[n]) for n in first)
        weights[-1] += sum(numel(modules[n]) for n in last)
        counts = balanced(weights, stages)
    return StagePlan(pp, virtual, tuple(blocks), tuple(counts), tuple(first), tuple(last))


# -- a rank's model --------------------------------------------------------------------------

@dataclass
class Stages:
    """What a rank holds: its stages (one per model chunk), the modules swapped out while each
    runs, and the parameter names it shares with another rank (tied)."""

    plan: StagePlan
    pp_rank: int
    chunks: list[int]  # the stage of each chunk
    swaps: dict[int, dict[str, nn.Module]] = field(default_factory=dict)  # chunk -> module name -> stand-in
    tied: frozenset[str] = frozenset()  # parameters another rank holds too (summed gradients)
    any_tied: bool = False  # whether any two stages share a parameter (every rank knows)
    absent: list[Absent] = field(default_factory=list)
    routers: object | None = None  # a mixture of experts' router logits (`models/routers.py`), or None
    routers_in: list[int] = field(default_factory=list)  # routers per stage

    @property
    def first(self) -> bool:
        """Whether this rank holds the model's first stage."""
        return 0 in self.chunks

    @property
    def last(self) -> bool:
        return self.plan.num_stages - 1 in self.chunks

    def is_first(self, chunk: int) -> bool:
        return self.chunks[chunk] == 0

    def is_last(self, chunk: int) -> bool:
        return self.chunks[chunk] == self.plan.num_stages - 1

    def set_dtype(self, dtype: torch.dtype) -> None:
        for a in self.absent:
            a.dtype = dtype


def stage_names(model: nn.Module, plan: StagePlan) -> list[set[str]]:
    """Every stage's parameter names (as the whole model names them), tied ones in each stage
    that uses them."""
    modules = dict(model.named_modules())
    name_of: dict[int, str] = {}
    for n, p in model.named_parameters():
        name_of.setdefault(id(p), n)
    return [{name_of[id(p)] for m in plan.modules(s) for p in modules[m].parameters()}
            for s in range(plan.num_stages)]


def split(model: nn.Module, plan: StagePlan, pp_rank: int) -> Stages:
    """Make `model` (still on the meta device) this rank's: modules of other ranks' stages
    replaced by stand-ins, in place. The stages' tied parameters are found first, on the whole."""
    chunks = plan.stages_of(pp_rank)
    names = stage_names(model, plan)
    mine = set().union(*(names[s] for s in chunks))
    others = set().union(*(names[s] for s in range(plan.num_stages) if s not in chunks))
    held = {m for s in chunks for m in plan.modules(s)}
    modules = dict(model.named_modules())
    kept_params = {id(p) for m in held for p in modules[m].parameters()}
    shared = any(names[s] & names[t] for s in range(plan.num_stages) for t in range(s))
    out = Stages(plan, pp_rank, chunks, tied=frozenset(mine & others), any_tied=shared)
    stand_ins: dict[str, nn.Module] = {}
    for name in (*plan.first, *plan.blocks, *plan.last):
        module = modules[name]
        stand_in = _stand_in(module) if name in plan.first else Passthrough()
        if isinstance(stand_in, Absent):
            out.absent.append(stand_in)
        if name in held:
            stand_ins[name] = stand_in
        elif any(id(p) in kept_params for p in module.parameters()):
            stand_ins[name] = stand_in  # holds a weight a held module uses: stays, swapped out while running
        else:
            _replace(model, name, stand_in)
    for c, s in enumerate(chunks):
        running = set(plan.modules(s))
        out.swaps[c] = {n: m for n, m in stand_ins.items() if n not in running}
    return out


def tied_axis(mesh, stages: Stages):
    """The group of the first and the last stage's ranks at this rank's other coordinates, over
    which tied parameters' gradients are summed (Megatron's embedding group): the pipeline
    group itself at two stages. Every rank must call it (groups are made collectively)."""
    import torch.distributed as dist

    from rayzero.sharding.comm import Axis

    p = mesh.size("pp")
    if not stages.any_tied:
        return None
    if p == 2:
        return mesh.axis("pp")
    mine = None
    for ranks in mesh.groups("pp"):
        ends = [ranks[0], ranks[-1]]
        group = dist.new_group(ends)
        if mesh.rank in ends:
            mine = Axis(group, 2, ends.index(mesh.rank))
    return mine


def _stand_in(module: nn.Module) -> nn.Module:
    dim = getattr(module, "embedding_dim", None)
    if dim is None:
        weight = getattr(module, "weight", None)
        dim = weight.shape[-1] if weight is not None else None
    return Absent(dim) if dim is not None else Passthrough()


def _replace(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = parent._modules[leaf]
    parent._modules[leaf] = new
    return old


class StopForward(Exception):
    """Raised once a stage's last block has run: the rest of the model's forward is another
    stage's."""


class StageRunner:
    """Runs one chunk of a rank's model: the model's own forward, with the modules of other
    chunks swapped out, the received activations given to the chunk's first block, and the
    forward stopped after its last block (whose output is the chunk's)."""

    def __init__(self, model: nn.Module, stages: Stages):
        self.model, self.stages = model, stages
        self.active: int | None = None
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        modules = dict(model.named_modules())
        for c, s in enumerate(stages.chunks):
            blocks = stages.plan.stage_blocks(s)
            if not stages.is_first(c):
                modules[blocks[0]].register_forward_pre_hook(self._take_input(c), with_kwargs=True, prepend=True)
            if not stages.is_last(c):
                modules[blocks[-1]].register_forward_hook(self._give_output(c))

    def _take_input(self, chunk: int):
        def hook(_module, args, kwargs):
            if self.active != chunk:
                return None
            if args:
                return (self._input, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": self._input}

        return hook

    def _give_output(self, chunk: int):
        def hook(_module, _args, output):
            if self.active == chunk:
                self._output = output
                raise StopForward

        return hook

    def run(self, chunk: int, received: torch.Tensor | None, call):
        """`call(model)` (the model seam's forward or loss) as chunk `chunk`: its result on the
        last stage, else the chunk's output activations."""
        swaps = self.stages.swaps[chunk]
        saved = {name: _replace(self.model, name, m) for name, m in swaps.items()}
        self.active, self._input, self._output = chunk, received, None
        try:
            return call(self.model)
        except StopForward:
            return self._output
        finally:
            for name, m in saved.items():
                _replace(self.model, name, m)
            self.active = self._input = self._output = None
