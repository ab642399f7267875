"""The objective seam: what a run optimises, as one object, the way the model seam is one object
for a model. An objective says

    data_kinds   the prepared data it reads (`meta.json`'s kind: text, instructions, preferences)
    loss         a micro-batch's loss summed, from the model's output (`Output`: its per-token
                 log-probabilities, or its logits), with the sums of its metrics
    count        what the loss is divided by: its count in a micro-batch, summed over the step's
                 micro-batches and the mesh's ranks before the first backward (valid targets by
                 default), so the gradient is the mean's at any world size or micro-batch split
    metrics      each one's merge across micro-batches, ranks and nodes (`Metric`: a sum, a mean
                 over the step's count or another metric's sum, a maximum)
    reference    the model it compares with: none, a frozen copy of the starting weights, the
                 base with the LoRA adapters off, or precomputed values
    record       what a checkpoint notes of it, compared when a run resumes

The runners (plain, pipelined) and the driver only ever call these: no objective's name is tested
outside `objectives/`. A user's own is a subclass of `Objective` in a module of theirs
(`train.objective=package.module:Class`, or `Trainer(config, objective=Class)`); the built-in ones
are registered by name (`objectives/__init__.py`). Pure torch: no Ray, no process groups (the rank
hands the objective what it needs: `RankObjective`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from rayzero.models.spec import per_token_nll, summed_nll
from rayzero.sharding.vocab_parallel import IGNORE_INDEX

# How a metric merges over micro-batches, ranks and nodes: summed; summed then divided by a count
# (the step's loss count, or another metric's sum); the largest.
Merge = Literal["sum", "mean", "max"]
# The model a loss compares the policy with.
REFERENCES = ("none", "frozen_copy", "adapters_off", "precomputed")
# The dataset kinds `rayzero data prepare` writes (`meta.json`'s kind).
DATA_KINDS = ("text", "instructions", "preferences", "prompts")


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """`model` in eval mode, under no_grad, for the span; back in training mode after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


@dataclass(frozen=True)
class Metric:
    """One metric an objective reports each step (to MLflow, the history and the summary), by
    `name`, and how the ranks' values merge: `sum`; `mean` = the summed values over the step's
    loss count (`over=None`) or over the summed metric `over`; `max`. `shown=False`: a sum kept
    only to divide another by (a count)."""

    name: str
    merge: Merge = "mean"
    over: str | None = None
    shown: bool = True

    def __post_init__(self):
        if self.merge not in ("sum", "mean", "max"):
            raise ValueError(f"metric {self.name}: merge must be sum, mean or max (got {self.merge!r})")
        if self.over is not None and self.merge != "mean":
            raise ValueError(f"metric {self.name}: `over` is for merge=mean")


class Output:
    """What the model's forward gave for one micro-batch, as a loss reads it: its logits (`[B, T,
    V]`; with the vocabulary split over tensor-parallel ranks, this rank's columns), the
    log-probability of each target (`token_logps`, 0 where the target is IGNORE_INDEX), and the
    model's own auxiliary loss. One forward, whatever is read."""

    def __init__(self, spec, logits: torch.Tensor, raw, batch, vocab=None):
        self.spec, self._logits, self._raw, self.batch, self.vocab = spec, logits, raw, batch, vocab
        self._nll: torch.Tensor | None = None
        self._tempered: dict[float, torch.Tensor] = {}

    @classmethod
    def of(cls, spec, model, batch, check: bool = False, vocab=None) -> Output:
        """The forward of `batch` through `model` (the model seam's; `check`: its output checked
        to be logits of the data's vocabulary first)."""
        logits, raw = spec.forward(model, batch, check, vocab)
        return cls(spec, logits, raw, batch, vocab)

    @property
    def logits(self) -> torch.Tensor:
        if self.vocab is not None:
            raise ValueError("this objective reads the model's whole logits, which tensor parallelism splits over "
                             "the vocabulary here (parallel.vocab_parallel); read `token_logps`, or run with "
                             "parallel.vocab_parallel=false")
        return self._logits

    def summed_nll(self) -> tuple[torch.Tensor, torch.Tensor | int]:
        """(the cross-entropy summed over the valid targets, their count): next-token's loss."""
        return summed_nll(self._logits, self.batch.targets, self.vocab)

    def token_nll(self) -> torch.Tensor:
        """Each target's cross-entropy [B, T] in fp32, 0 where it is IGNORE_INDEX."""
        if self._nll is None:
            self._nll = per_token_nll(self._logits, self.batch.targets, self.vocab)
        return self._nll

    def tempered_logps(self, temperature: float) -> torch.Tensor:
        """Each target's log-probability [B, T] under the logits divided by `temperature` (what a
        sampler at that temperature drew from, as TRL's GRPO computes it), 0 where it is
        IGNORE_INDEX."""
        if temperature == 1.0:
            return self.token_logps
        if temperature not in self._tempered:
            self._tempered[temperature] = -per_token_nll(self._logits / temperature, self.batch.targets, self.vocab)
        return self._tempered[temperature]

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """Each position's entropy [B, T] of the softmax of the logits over `temperature` (over the
        whole vocabulary where it is split over tensor-parallel ranks), in fp32, without gradient."""
        x = self._logits.detach().float() / temperature
        if self.vocab is not None:
            return self.vocab.entropy(x)
        logps = torch.log_softmax(x, -1)
        return -(logps.exp() * logps).sum(-1)

    @property
    def token_logps(self) -> torch.Tensor:
        """Each target's log-probability [B, T] in fp32, 0 where it is IGNORE_INDEX."""
        return -self.token_nll()

    @property
    def aux(self) -> torch.Tensor | None:
        """The model's auxiliary loss (a mixture of experts' router loss), or None."""
        return self.spec.aux_loss(self._raw)


class Objective:
    """What a run optimises. Subclass it for an objective of your own and name it in
    `train.objective=package.module:Class` (the module importable where you run `rayzero train`;
    it is sent to the ranks). Override `loss` (and, as needed, `count`, `metrics`, `data_kinds`,
    `check`); the instance is made on the driver and on every rank from the run's config.

    The step's loss is `sum over micro-batches and ranks of loss(...)[0]` divided by the same sum
    of `count(batch)`: the mean over whatever `count` counts (valid targets by default), the same
    at any world size and micro-batch split."""

    name = ""  # the registry's name, or the class's `module:qualname` (set when it is resolved)
    data_kinds: tuple[str, ...] = ("text", "instructions")
    metrics: tuple[Metric, ...] = ()
    # The model `loss` compares with: "none"; "frozen_copy" (the starting weights, frozen, sharded
    # like the policy); "adapters_off" (a LoRA run's base). With one, each micro-batch carries the
    # reference's log-probability of each target as the token field `ref_logps`.
    reference: str = "none"
    perplexity = False  # whether validation reports exp(loss) too (a mean cross-entropy)
    # Whether its rows are the policy's own completions (online RL): the driver then samples them
    # on rollout actors, scores them with the reward functions and hands each step its rows
    # (`cluster/rollouts.py`), and the ranks send their weights to the actors before each round.
    samples = False
    summary = "objective"  # the run summary's keys for its metrics: final_<summary>, final_val_<summary>
    fine_tuning_lr: tuple[float, float] = (2e-5, 2e-4)  # optim.lr's default from pretrained weights (full, LoRA)
    # Whether the loss is computed on whole rows even with context parallelism (a loss over whole
    # sequences: each cp rank sums its part of a row and the parts are added), so that one rank of
    # a cp group counts it; else each rank's tokens count.
    whole_rows = False

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def check(cls, cfg) -> None:
        """Refuse a configuration this objective cannot train, with a ValueError naming the key
        (called before anything starts)."""

    # -- on every rank, per micro-batch ------------------------------------------------------
    def prepare(self, batch):
        """The micro-batch of whole rows (before context parallelism splits its tokens) with
        fields of the objective's own added (`batch.with_fields(rows=..., tokens=...)`), which
        `loss` then reads from `batch.row_fields` / `batch.token_fields`; as it is by default."""
        return batch

    def count(self, batch) -> float | torch.Tensor:
        """What this micro-batch adds to the step's divisor: its valid targets by default."""
        return (batch.targets != IGNORE_INDEX).sum()

    def loss(self, out: Output, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this micro-batch's loss summed (rayzero divides it by the step's count), the sums of
        its metrics (a `mean` metric: summed like the loss; a `max`: this micro-batch's maximum)).
        `out`: the model's output (`Output`); `batch`: the micro-batch (`MicroBatch`: tokens,
        targets, the loss mask, positions and example ids of packed rows, and the fields the
        data gave)."""
        raise NotImplementedError(f"{type(self).__name__}.loss")

    # -- on the driver ----------------------------------------------------------------------
    def record(self, model: dict | None) -> dict:
        """What a checkpoint notes of the objective (`model`: the model's record, for a
        reference): its name, and under "checked" what a resume must match (the class's keyword
        arguments, `train.objective_kwargs`); a resume with a different name or "checked" is
        refused."""
        kwargs = self.cfg.train.objective_kwargs
        return {"name": self.name, **({"checked": {"kwargs": dict(kwargs)}} if kwargs else {})}

    def plan(self, params_per_rank: int | None, frozen_bytes_per_param: float, param_dtype: str) -> dict | None:
        """What `--dry-run` says of the objective: its name, its metrics, its keyword arguments and
        its reference model (a frozen copy's bytes per rank, sharded as frozen parameters are)."""
        held = int(frozen_bytes_per_param * params_per_rank) if params_per_rank and self.reference == "frozen_copy" \
            else 0
        ref = {"none": "none", "adapters_off": "the base model with the LoRA adapters off (no copy)",
               "frozen_copy": f"a frozen copy of the starting weights in {param_dtype}"
               + (f", {held / 2**20:,.1f} MiB per rank" if held else "")}[self.reference]
        kwargs = self.cfg.train.objective_kwargs
        line = (f"objective {self.name}" + (f" ({', '.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else "")
                + f"; metrics: {', '.join(self.metric_names()) or 'none'}; reference: {ref}")
        return {"name": self.name, "reference": self.reference, "reference_bytes": held, "line": line}

    def rollout_plan(self, params: int | None, trainable: int | None) -> dict | None:
        """What `--dry-run` says of the driver's side (online RL's rollout actors), or None;
        `params`, `trainable`: the whole model's counts (None where the model is not read here)."""
        return None

    def step_metrics(self, sums: dict, count: float, prefix: str = "") -> dict[str, float]:
        """The step's metrics from the merged sums (`metric_sums`) and the step's loss count."""
        out = {}
        for m in self.metrics:
            if not m.shown:
                continue
            if m.merge == "max":
                value = sums.get("max", {}).get(m.name)
            else:
                value = sums.get("sum", {}).get(m.name)
                if value is not None and m.merge == "mean":
                    value /= max(sums["sum"].get(m.over, 0.0) if m.over else count, 1.0)
            if value is not None:
                out[prefix + m.name] = value
        return out

    def metric_names(self, prefix: str = "") -> list[str]:
        return [prefix + m.name for m in self.metrics if m.shown]

    def rank_side(self, ctx) -> "RankObjective":
        """The objective's part on a rank (`ctx`: the runner's `StepContext`)."""
        return SummedLoss(self, ctx)


def metric_sums(objective: Objective, sums: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A micro-batch's (or a step's) metric values split by how they merge: {"sum": ..., "max": ...};
    a value the objective does not declare is an error, never dropped."""
    merges = {m.name: m.merge for m in objective.metrics}
    out: dict[str, dict] = {"sum": {}, "max": {}}
    for k, v in sums.items():
        if k not in merges:
            raise ValueError(f"{type(objective).__name__}.loss returned the metric {k!r}, which its `metrics` do not "
                             f"declare (declared: {', '.join(merges) or 'none'})")
        out["max" if merges[k] == "max" else "sum"][k] = v
    return out


def add_metric_sums(total: dict, part: dict) -> dict:
    """`part` ({"sum", "max"} of tensors) merged into `total` in place, on the device."""
    sums, maxima = total.setdefault("sum", {}), total.setdefault("max", {})
    for k, v in part.get("sum", {}).items():
        sums[k] = sums[k] + v if k in sums else v
    for k, v in part.get("max", {}).items():
        maxima[k] = torch.maximum(maxima[k], v) if k in maxima else v
    return total


def as_numbers(sums: dict) -> dict:
    """{"sum", "max"} of device tensors as floats, read in one go (once a step)."""
    keys = [(g, k) for g in ("sum", "max") for k in sums.get(g, {})]
    if not keys:
        return {"sum": {}, "max": {}}
    values = torch.stack([torch.as_tensor(sums[g][k]).double().reshape(()) for g, k in keys]).tolist()
    out: dict = {"sum": {}, "max": {}}
    for (g, k), v in zip(keys, values):
        out[g][k] = v
    return out


# -- on a rank -------------------------------------------------------------------------------------
class RankObjective:
    """An objective's part on one rank, as the runners call it for every objective alike:

        prepare(batch)                    a micro-batch's own fields added, on whole rows
        begin(micro, rows, step, whole)   the step starts: its counts, summed over the mesh
        ready()                           (pipelined) the counts waited for, on every stage
        loss(model, batch, check, index)  a micro-batch's part of the step's mean loss, and the
                                          model's auxiliary loss (or None); its sums kept
        end()                             the step's sums (`StepSums`)
        validate(val)                     the sums over this rank's validation rows
    """

    def prepare(self, batch):
        """A micro-batch of whole rows, before context parallelism splits it: the objective's own
        fields added (`MicroBatch.with_fields`), which then travel with it."""
        return batch

    def begin(self, micro, rows, step: int, whole) -> None: ...

    def ready(self) -> None:
        """The step's divisor waited for (every pipeline stage does, though only the last uses it)."""

    def loss(self, model, batch, check: bool, index: int): ...

    def end(self) -> StepSums: ...

    def validate(self, val) -> StepSums: ...

    def memory(self) -> dict[str, int]:
        return {}


@dataclass
class StepSums:
    """A step's (or a validation's) sums on one rank: the loss summed as the step divides it, the
    count it divides by, and the objective's metrics ({"sum", "max"}, numbers)."""

    loss_sum: float
    count: float | int
    metrics: dict


class Counts:
    """The step's divisor: this rank's count summed over a role of the mesh by an all-reduce
    started when the step begins and waited for at the first loss (queued behind any parameter
    all-gather in flight, so it costs no overlap); or known up front."""

    def __init__(self, value: float | torch.Tensor, work=None):
        self._value, self._work = value, work

    @classmethod
    def summed(cls, local: torch.Tensor, axis) -> Counts:
        return cls(local, axis.start_all_reduce(local))

    def value(self) -> float:
        if self._work is not None:
            from rayzero.sharding.comm import wait

            wait(self._work)
            self._work = None
        if isinstance(self._value, torch.Tensor):
            self._value = max(float(self._value.item()), 1.0)
        return self._value


class SummedLoss(RankObjective):
    """A loss summed over a micro-batch's tokens (or whatever `count` counts), divided by the
    step's count over the `loss` role's ranks: next-token's and a user objective's. With the
    default count on data whose every target counts, the divisor is known up front."""

    def __init__(self, objective: Objective, ctx):
        self.o, self.ctx = objective, ctx
        self.counts = Counts(1.0)
        self.loss_sum = self.tokens = self.sums = None
        self._default_count = type(objective).count is Objective.count
        self._refs: list | None = None  # in a pipeline, with a reference: its log-probs of the step's micro-batches
        self.ref_temperature = 1.0  # the reference's log-probabilities at this sampling temperature (GRPO's)

    def begin(self, micro, rows, step: int, whole) -> None:
        ctx = self.ctx
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        self.tokens, self.sums = 0, {}
        if ctx.reference is not None and ctx.pipe is not None:  # through the stages before the schedule
            self._refs = ctx.reference.stage_values(ctx.pipe, micro, _logps, self.ref_temperature) or [None] * len(micro)
        if self._default_count and not ctx.masks_labels:
            self.counts = Counts(float(ctx.tokens_per_step))
            return
        if self._default_count:  # valid targets, counted on the host: nothing waits for the device
            local = float(sum(int((b.targets != IGNORE_INDEX).sum()) for b in rows))
        else:  # the objective's own count, of its micro-batches as its loss sees them (fields and all)
            local = float(sum(float(self.o.count(b)) for b in micro))
        self.counts = Counts.summed(torch.tensor([local], dtype=torch.float64, device=ctx.device), ctx.loss_axis)

    def ready(self) -> None:
        self.counts.value()

    def prepare(self, batch):
        return self.o.prepare(batch)

    def forward(self, model, batch, check: bool):
        return Output.of(self.ctx.spec, model, batch, check, self.ctx.vocab)

    def _with_reference(self, batch, ref=None):
        """The batch with the reference's log-probability of each target (`ref_logps`, a token
        field), where the objective has a reference model."""
        reference = self.ctx.reference
        if reference is None:
            return batch
        ref = ref if ref is not None else reference.values(batch, _logps, self.ref_temperature)
        return batch.with_fields(tokens={"ref_logps": ref})

    def loss(self, model, batch, check: bool, index: int):
        batch = self._with_reference(batch, self._refs[index] if self._refs is not None else None)
        out = self.forward(model, batch, check)
        loss_sum, sums = self._loss(out, batch)
        if sums:
            add_metric_sums(self.sums, metric_sums(self.o, {k: v.detach() for k, v in sums.items()}))
        return loss_sum / self.counts.value(), out.aux

    def _loss(self, out: Output, batch):
        loss_sum, sums = self.o.loss(out, batch)
        self.loss_sum += loss_sum.detach()
        self.tokens += self.o.count(batch) if not self._default_count else (batch.targets != IGNORE_INDEX).sum()
        return loss_sum, sums

    def end(self) -> StepSums:
        return StepSums(float(self.loss_sum), _number(self.tokens), as_numbers(self.sums))

    def memory(self) -> dict[str, int]:
        return self.ctx.reference.memory() if self.ctx.reference is not None else {}

    def validate(self, val) -> StepSums:
        """Forward only, over this rank's validation rows (its tokens of them with cp)."""
        ctx = self.ctx
        loss_sum, count, sums = torch.zeros((), dtype=torch.float64, device=ctx.device), 0, {}
        micro = [self.prepare(b.to(ctx.device)) for k in range(val.num_batches) for b in val.microbatches(k)]
        micro = micro if ctx.cp is None else [b.split(ctx.cp) for b in micro]

        refs = iter(ctx.reference.stage_values(ctx.pipe, micro, _logps, self.ref_temperature) if ctx.reference is not None
                    and ctx.pipe is not None else [])

        def one(model, batch):
            batch = self._with_reference(batch, next(refs, None))
            out = Output.of(ctx.spec, model, batch, vocab=ctx.vocab)
            part, got = self.o.loss(out, batch)
            return part, self.o.count(batch), got

        parts = ctx.pipe.forward_only(micro, one) if ctx.pipe is not None else [one(ctx.model, b) for b in micro]
        for part, n, got in parts:
            loss_sum += part.double()
            count += _number(n)
            if got:
                add_metric_sums(sums, metric_sums(self.o, got))
        return StepSums(float(loss_sum), count, as_numbers(sums))


def _logps(nll: torch.Tensor) -> torch.Tensor:
    """Each target's log-probability from its cross-entropy."""
    return -nll


def _number(n) -> float | int:
    if isinstance(n, torch.Tensor):
        return n.item()
    return n
