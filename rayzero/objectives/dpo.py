"""Preference losses over pairs of completions, as TRL's `DPOTrainer` (and, for `orpo`, its
`ORPOTrainer`) computes them. Pure torch: no process groups, no model.

A preference micro-batch holds pairs as rows (2i, 2i + 1) = (chosen, rejected) of pair i, each
row's labels IGNORE_INDEX except on its completion's tokens (`data/preferences.py`). From the
per-token cross-entropy of the policy (and the reference's sequence log-probabilities):

    logp(seq)  = sum over the completion's tokens of log p(token | before)   (TRL: summed)
    margin     = (logp_c - ref_c) - (logp_r - ref_r)
    sigmoid    = -log σ(β margin)
    robust     = (-(1 - ε) log σ(β margin) + ε log σ(-β margin)) / (1 - 2ε)   (ε = label_smoothing)
    hinge      = relu(1 - β margin)
    ipo        = ((logp_c - ref_c)/n_c - (logp_r - ref_r)/n_r - 1/(2β))²    (per completion token)
    orpo       = NLL of the chosen completions' tokens (their mean over the batch; ORPO's L_SFT,
                 where TRL's ORPOTrainer takes the prompt's tokens too) - β log σ(log odds),
                 log odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)), a = logp / n

The loss of a step is the mean over its pairs (ORPO's NLL: over its chosen tokens): each rank
sums over its pairs and divides by the step's global count, so that summed over micro-batches
and ranks the gradient is that of the mean, at any world size. Empty pairs (the filler at the
end of an epoch) have no completion tokens and take no part.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayzero.data.microbatch import MicroBatch
from rayzero.objectives.base import Metric, Objective, Output, RankObjective, StepSums, evaluating
from rayzero.objectives.config import DPOConfig
from rayzero.objectives.registry import reference_record
from rayzero.sharding.comm import wait
from rayzero.sharding.vocab_parallel import IGNORE_INDEX

# What a run reports of its pairs, under TRL's names: each the mean over the step's pairs.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation (branching at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass
class Pairs:
    """One micro-batch's pairs, seen through its labels: the completion tokens each chosen and
    rejected row has, and which pairs are real (not filler)."""

    chosen_tokens: torch.Tensor  # [P], float
    rejected_tokens: torch.Tensor  # [P], float
    valid: torch.Tensor  # [P], bool

    @classmethod
    def of(cls, targets: torch.Tensor) -> "Pairs":
        return cls.counted(row_tokens(targets))

    @classmethod
    def counted(cls, tokens: torch.Tensor) -> "Pairs":
        """From each row's completion tokens (`row_tokens`: [rows], float)."""
        if tokens.shape[0] % 2:
            raise ValueError(f"a preference micro-batch holds pairs of rows; this one has {tokens.shape[0]} rows")
        chosen, rejected = tokens[0::2], tokens[1::2]
        return cls(chosen, rejected, (chosen > 0) & (rejected > 0))


def row_tokens(targets: torch.Tensor) -> torch.Tensor:
    """Each row's completion tokens (its targets not IGNORE_INDEX), float: [rows, T] -> [rows]."""
    return (targets != IGNORE_INDEX).sum(-1).float()


def sequence_logps(token_losses: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its completion: minus its per-token cross-entropy summed
    (0 where the label is IGNORE_INDEX). [rows, T] -> [rows]."""
    return -token_losses.sum(-1)


def counts(targets: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[pairs, chosen completion tokens] of a micro-batch's real pairs, float64 on the targets'
    device: what a step divides its loss by, summed over micro-batches and ranks (`tokens`: the
    rows' completion tokens, when the targets are a part of each row)."""
    pairs = Pairs.of(targets) if tokens is None else Pairs.counted(tokens)
    return torch.stack([pairs.valid.sum(), (pairs.chosen_tokens * pairs.valid).sum()]).double()


class PreferenceLoss:
    """`dpo.loss` over one micro-batch: its part of the step's mean loss, and the sums of the
    metrics over its real pairs (divided by the step's pair count when reported)."""

    def __init__(self, cfg: DPOConfig):
        self.cfg = cfg

    def __call__(self, token_losses: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None,
                 divisors: tuple[float, float], tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """`token_losses`: the policy's per-token cross-entropy [rows, T] (fp32; or each row's
        sum, [rows, 1], with `tokens`: the rows' completion tokens); `ref`: the reference's
        sequence log-probabilities [rows] (None for a reference-free loss); `divisors`: the
        step's (pairs, chosen completion tokens) over every rank. The sums are 0-d float64
        tensors on the loss's device (`as_floats` reads them)."""
        cfg, beta = self.cfg, self.cfg.beta
        pairs = Pairs.of(targets) if tokens is None else Pairs.counted(tokens)
        logps = sequence_logps(token_losses)
        chosen, rejected = logps[0::2], logps[1::2]
        n_c, n_r = pairs.chosen_tokens.clamp(min=1.0), pairs.rejected_tokens.clamp(min=1.0)
        extra: dict[str, torch.Tensor] = {}
        if cfg.loss == "orpo":
            avg_c, avg_r = chosen / n_c, rejected / n_r
            log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
            ratio = F.logsigmoid(log_odds)
            nll_sum = token_losses[0::2].sum(-1)  # the chosen rows' cross-entropy, summed
            per_pair = -beta * ratio
            r_chosen, r_rejected = beta * avg_c.detach(), beta * avg_r.detach()
            loss = (nll_sum * pairs.valid).sum() / max(divisors[1], 1.0)
            shown_c, shown_r = avg_c, avg_r  # TRL's ORPO logs the per-token mean log-probabilities
            extra = {"nll_loss": nll_sum.detach() * divisors[0] / max(divisors[1], 1.0),
                     "log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
        else:
            if ref is None:
                raise ValueError(f"dpo.loss={cfg.loss} compares with a reference model, and none was given")
            ref_c, ref_r = ref[0::2], ref[1::2]
            lr_c, lr_r = chosen - ref_c, rejected - ref_r
            margin = lr_c - lr_r
            eps = cfg.label_smoothing
            if cfg.loss == "sigmoid":
                per_pair = -F.logsigmoid(beta * margin)
            elif cfg.loss == "robust":
                per_pair = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
            elif cfg.loss == "hinge":
                per_pair = torch.relu(1 - beta * margin)
            elif cfg.loss == "ipo":
                per_pair = (lr_c / n_c - lr_r / n_r - 1 / (2 * beta)) ** 2
            else:
                raise ValueError(f"dpo.loss: unknown loss {cfg.loss!r}")
            r_chosen, r_rejected = beta * lr_c.detach(), beta * lr_r.detach()
            loss = torch.zeros((), dtype=per_pair.dtype, device=per_pair.device)
            shown_c, shown_r = chosen, rejected
        loss = loss + (per_pair * pairs.valid).sum() / max(divisors[0], 1.0)
        valid = pairs.valid
        values = {
            "rewards/chosen": r_chosen, "rewards/rejected": r_rejected,
            "rewards/accuracies": (r_chosen > r_rejected).float(), "rewards/margins": r_chosen - r_rejected,
            "logps/chosen": shown_c.detach(), "logps/rejected": shown_r.detach(), **extra,
        }
        sums = {k: (v.double() * valid).sum() for k, v in values.items()}
        # the step's loss, as summed over ranks: this micro-batch's part of it, times the pair count
        sums["loss"] = loss.detach().double() * divisors[0]
        sums["pairs"] = valid.sum().double()
        return loss, sums


def add_sums(total: dict, part: dict) -> dict:
    """`part`'s sums added into `total`'s, key by key (tensors stay on their device)."""
    for k, v in part.items():
        total[k] = total[k] + v if k in total else v
    return total


def as_floats(sums: dict) -> dict[str, float]:
    """The sums as numbers, read from the device in one go (once a step, not per micro-batch)."""
    if not sums:
        return {}
    keys = list(sums)
    return dict(zip(keys, torch.stack([sums[k] for k in keys]).tolist()))


def pair_metrics(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """The step's means over its pairs, by TRL's names (`prefix`: `val_` for validation)."""
    n = max(sums.get("pairs", 0.0), 1.0)
    return {f"{prefix}{k}": v / n for k, v in sums.items() if k not in ("pairs", "loss")}


# -- the objective -------------------------------------------------------------------------------
class DPO(Objective):
    """`train.objective=dpo`: the pair loss `dpo.loss` over preference pairs (`data prepare
    --preferences`), against a reference model (none for `orpo`), TRL's metrics by its names,
    each the mean over the step's pairs."""

    data_kinds = ("preferences",)
    summary = "preferences"
    fine_tuning_lr = (1e-6, 1e-5)  # TRL's DPOConfig; about ten times that with LoRA
    whole_rows = True  # a pair's loss is a function of whole sequences: one rank of a cp group counts it
    resume_hint = "to tune its result on preferences, export it (train.save_final) and start from it with model.path"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.options: DPOConfig = cfg.dpo

    @property
    def metrics(self) -> tuple[Metric, ...]:
        names = PAIR_METRICS + (ORPO_METRICS if self.options.loss == "orpo" else ())
        return (*(Metric(n, "mean", over="pairs") for n in names), Metric("pairs", "sum", shown=False))

    @property
    def reference(self) -> str:
        """The model the rewards are measured against: none (ORPO), the base with the adapters
        off (LoRA), or a frozen copy of the starting weights; `precompute_ref`: its values taken
        before training by one of those, which is then dropped."""
        if not self.options.uses_reference:
            return "none"
        return "adapters_off" if self.cfg.model.lora is not None else "frozen_copy"

    def record(self, model: dict | None) -> dict:
        ref = reference_record(self.reference, model) if self.options.uses_reference else None
        return {"name": self.name, "loss": self.options.loss, "reference": ref}

    def plan(self, params_per_rank: int | None, frozen_bytes_per_param: float, param_dtype: str) -> dict:
        """The loss, and the reference model's bytes per rank, in the compute dtype and sharded as
        frozen parameters are (a frozen copy: its parameters x `frozen_bytes_per_param`; none for
        LoRA, whose reference is the base with the adapters off, a reference-free loss, or a
        precomputed reference, which holds it only for the pass before training)."""
        d = self.options
        if not d.uses_reference:
            how, held = "none (reference-free)", 0
        elif self.cfg.model.lora is not None:
            how, held = "the base model with the LoRA adapters off (no copy)", 0
        else:
            how = f"a frozen copy of the starting weights in {param_dtype}, sharded like the policy"
            held = int(frozen_bytes_per_param * params_per_rank) if params_per_rank else None
        before = held if d.precompute_ref else 0
        plan = {"loss": d.loss, "beta": d.beta, "reference": how, "precompute_ref": d.precompute_ref,
                "reference_bytes": 0 if d.precompute_ref else held, "reference_bytes_before_training": before}
        return {**plan, "line": _plan_line(plan)}

    def rank_side(self, ctx) -> "PreferenceStep":
        if self.options.disable_dropout:  # TRL's default: the policy's log-probabilities without dropout's noise
            disable_dropout(ctx.model)
        reference = ctx.reference
        if reference is not None and self.options.precompute_ref:  # every pair's once, now; then dropped
            reference = precompute(reference, ctx.pipe, ctx.mesh, ctx.device, splits_of(ctx.data, ctx.val),
                                   self.cfg.train.micro_batch_size, ctx.cp)
            gc.collect()
        return PreferenceStep(self, ctx, reference)


def _plan_line(o: dict) -> str:
    """The dry run's line for `DPO.plan`."""
    mib = (lambda b: f"{b / 2**20:,.1f} MiB per rank" if b is not None else "its size unknown here")
    ref = o["reference"]
    if o["precompute_ref"]:
        ref += f"; its log-probabilities precomputed before training ({mib(o['reference_bytes_before_training'])} " \
               "then), then dropped"
    elif o["reference_bytes"]:
        ref += f": {mib(o['reference_bytes'])} beside the model state (no gradient, main copy or optimizer state)"
    return f"objective dpo, loss {o['loss']} (beta {o['beta']:g}); reference: {ref}"


def disable_dropout(model: nn.Module) -> None:
    """No dropout anywhere in `model`: its dropout modules at p=0 (TRL's `disable_dropout_in_model`),
    and the rates attention modules keep as floats for their kernel (`attention_dropout`, `dropout`)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)


# -- on a rank -----------------------------------------------------------------------------------
class Precomputed:
    """Every pair's reference log-probabilities, computed once before training by a reference
    that is then dropped (`dpo.precompute_ref`): a table per split ("train", "val") of
    [pairs, (chosen, rejected)], looked up by pair id (EMPTY: a filler pair, 0)."""

    def __init__(self, tables: dict[str, torch.Tensor]):
        self.tables = tables

    def logps(self, ids) -> torch.Tensor:
        split, pair_ids = ids
        table = self.tables[split]
        index = torch.as_tensor(pair_ids, dtype=torch.long, device=table.device)
        rows = table[index.clamp(min=0)].masked_fill((index < 0).unsqueeze(-1), 0.0)
        return rows.flatten().to(torch.float32)  # chosen, rejected, chosen, ...: the rows' order

    def memory(self) -> dict[str, int]:
        return {"reference_params": 0}


CHUNK = 64  # micro-batches a precomputing pass holds at once


def precompute(reference, pipe, mesh, device, splits: dict, micro_rows: int, cp=None) -> Precomputed:
    """`dpo.precompute_ref`: each split's pairs (`splits`: name -> (its `Pairs`, how many)) in
    micro-batches of `micro_rows` rows, the data-parallel ranks taking turns, through
    `reference` (in a pipeline, through the stages; with `cp`, each rank its part of the rows,
    the sums added over the cp group); the tables summed over the data-parallel ranks, so each
    holds every pair's (the last stage's, in a pipeline)."""
    from rayzero.data.preferences import EMPTY

    per = micro_rows // 2
    dp, me = mesh.size("batch"), mesh.coord("batch")
    tables = {}
    for name, (pairs, count) in splits.items():
        table = torch.zeros(count, 2, dtype=torch.float64, device=device)
        chunks = [list(range(i, min(i + per, count))) for i in range(0, count, per)]
        # the same number of micro-batches on every rank (the collectives of ZeRO-3 and TP run
        # in step): the last turn's missing ones are all filler
        chunks += [[] for _ in range(-len(chunks) % dp)]
        mine = chunks[me::dp]
        for at in range(0, len(mine), CHUNK):
            ids = mine[at: at + CHUNK]
            micro = []
            for chunk in ids:
                tokens, labels = pairs.rows(chunk + [EMPTY] * (per - len(chunk)))
                batch = MicroBatch(torch.from_numpy(tokens[:, :-1]), torch.from_numpy(labels[:, 1:])).to(device)
                micro.append(batch if cp is None else batch.split(cp))
            got = (reference.stage_values(pipe, micro, sequence_logps) if pipe is not None
                   else [reference.values(b, sequence_logps) for b in micro])
            got = got if cp is None else [cp.whole(lp) for lp in got]
            for chunk, lp in zip(ids, got):
                if chunk:
                    index = torch.as_tensor(chunk, dtype=torch.long, device=device)
                    table[index] = lp.double().view(-1, 2)[: len(chunk)]
        wait(mesh.axis("batch").start_all_reduce(table))
        tables[name] = table
    return Precomputed(tables)


class PreferenceStep(RankObjective):
    """Each micro-batch's preference loss on this rank: the step's divisors (its pairs and
    chosen completion tokens over every rank, all-reduced once at the start of the step), the
    reference's log-probabilities, and the metrics' sums. In a pipeline, the last stage computes
    the loss, and the reference's log-probabilities come from a forward-only pass through the
    stages before the step's schedule.

    With context parallelism the two rows of a pair are split alike (each rank of a cp group
    holds its part of both), and a pair's loss is a function of whole sequences: each rank sums
    its tokens' log-probabilities per row, the sums are added over the cp group
    (`ContextParallel.whole`), and every rank of the group computes the pair loss from the whole
    rows' sums and completion token counts (counted in the unsplit rows). The group's ranks then
    hold the same loss and metrics, which count once (the step's pairs are summed over the
    `batch` role, and one rank of the cp group reports them); each rank's gradient is its own
    tokens' part of the loss's."""

    def __init__(self, objective: DPO, ctx, reference):
        self.o, self.ctx, self.reference = objective, ctx, reference
        self.spec, self.model, self.vocab, self.pipe, self.cp = ctx.spec, ctx.model, ctx.vocab, ctx.pipe, ctx.cp
        self.loss_fn = PreferenceLoss(objective.options)
        self._divisors: tuple[float, float] | torch.Tensor = (1.0, 1.0)
        self._work = None
        self._refs: list | None = None  # in a pipeline: the step's reference log-probabilities, per micro-batch
        self._ids = None
        self.sums: dict[str, torch.Tensor] = {}  # this step's, on the device until `end`

    @property
    def _precomputed(self) -> bool:
        return isinstance(self.reference, Precomputed)

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """Each row's completion tokens, counted in the whole rows (a row field: with cp, every
        rank of the group has the whole row's)."""
        return batch.with_fields(rows={"completion_tokens": row_tokens(batch.targets)})

    def begin(self, micro, rows, step: int, whole) -> None:
        """Step `step` starts on `micro` (with cp, this rank's part of each row): count its pairs
        (summed over the data-parallel ranks, waited for at the first forward) and clear the
        sums; in a pipeline, the reference's pass through the stages."""
        self._divisors = torch.stack([counts(b.targets, b.row_fields["completion_tokens"]) for b in micro]).sum(0)
        self._work = self.ctx.mesh.axis("batch").start_all_reduce(self._divisors)
        self.sums = {}
        self._ids = step_ids(self.ctx.data, step) if self._precomputed else None
        if self.pipe is not None:
            self._refs = self.references(micro, self._ids)

    def references(self, micro, ids) -> list:
        """The reference's log-probabilities of each micro-batch through the pipeline (on the
        last stage; None for each elsewhere, and without a reference)."""
        if self.reference is None:
            return [None] * len(micro)
        if self._precomputed:
            got = [self.reference.logps(i) for i in ids] if self.pipe.stages.last else []
        else:
            got = self.reference.stage_values(self.pipe, micro, sequence_logps)
        return [self._whole_ref(r) for r in got] if got else [None] * len(micro)

    def _ref_of(self, batch, ids):
        if self.reference is None:
            return None
        if self._precomputed:
            return self.reference.logps(ids)
        return self._whole_ref(self.reference.values(batch, sequence_logps))

    def _whole_ref(self, ref):
        """The reference's log-probabilities of whole rows (with cp, its parts' summed; a
        precomputed table's are whole already)."""
        return ref if self.cp is None or ref is None or self._precomputed else self.cp.whole(ref)

    def _rows(self, per_token: torch.Tensor) -> torch.Tensor:
        """The policy's per-token losses as the pair loss takes them: with cp, each whole row's sum."""
        return per_token if self.cp is None else self.cp.whole(per_token.sum(-1, keepdim=True))

    def divisors(self) -> tuple[float, float]:
        if self._work is not None:
            wait(self._work)
            self._work = None
        if isinstance(self._divisors, torch.Tensor):
            self._divisors = tuple(float(v) for v in self._divisors.cpu())
        return self._divisors

    def loss(self, model, batch: MicroBatch, check: bool, index: int):
        """(micro-batch `index`'s part of the step's loss, the model's auxiliary loss or None)."""
        if self.pipe is not None:
            ref = self._refs[index]
        else:
            ref = self._ref_of(batch, self._ids[index] if self._ids is not None else None)
        out = Output.of(self.spec, model, batch, check, self.vocab)
        loss, sums = self.loss_fn(self._rows(out.token_nll()), batch.targets, ref, self.divisors(),
                                  batch.row_fields["completion_tokens"])
        add_sums(self.sums, sums)
        return loss, out.aux

    def end(self) -> StepSums:
        return _step_sums(as_floats(self.sums))

    def validate(self, val) -> StepSums:
        """The metrics' sums over this rank's validation rows, forward only; the loss summed per
        pair (the controller divides by the pairs)."""
        ctx = self.ctx
        whole = [self.prepare(b.to(ctx.device)) for k in range(val.num_batches) for b in val.microbatches(k)]
        micro = whole if self.cp is None else [b.split(self.cp) for b in whole]
        ids = val_ids(val) if self._precomputed else [None] * len(micro)
        total: dict[str, torch.Tensor] = {}

        def last(m, batch, ref):
            per_token, _ = self.spec.token_losses(m, batch, vocab=self.vocab)
            n = batch.row_fields["completion_tokens"]
            divisors = counts(batch.targets, n).clamp(min=1.0).tolist()
            return self.loss_fn(self._rows(per_token), batch.targets, ref, (divisors[0], divisors[1]), n)[1]

        if self.pipe is not None:
            refs = iter(self.references(micro, ids))
            with evaluating(self.model):
                for sums in self.pipe.forward_only(micro, lambda m, b: last(m, b, next(refs))):
                    add_sums(total, sums)
            return _step_sums(as_floats(total))
        with evaluating(self.model):
            for b, i in zip(micro, ids):
                add_sums(total, last(self.model, b, self._ref_of(b, i)))
        return _step_sums(as_floats(total))

    def memory(self) -> dict[str, int]:
        return self.reference.memory() if self.reference is not None else {}


def _step_sums(sums: dict[str, float]) -> StepSums:
    """A step's pair sums as the report carries them: the loss summed per pair, the pairs, the metrics."""
    metrics = {k: v for k, v in sums.items() if k != "loss"}
    return StepSums(sums.get("loss", 0.0), int(sums.get("pairs", 0)), {"sum": metrics, "max": {}})


def splits_of(data, val) -> dict:
    """What a precomputed reference covers: the training pairs, and the validation pairs
    evaluation reads (`Pairs` and how many of each)."""
    out = {"train": (data.index, data.epochs.num_pairs)}
    if val is not None:
        out["val"] = (val.index, val.num_rows)
    return out


def step_ids(data, step: int) -> list[tuple[str, list[int]]]:
    """The pair ids of this rank's micro-batches at `step`, in order (as `PreferenceBatches` reads them)."""
    per_rank, per = data.rows_per_rank // 2, data.micro_batch // 2
    mine = data.epochs.step_pairs(step)[data.dp_rank * per_rank: (data.dp_rank + 1) * per_rank].tolist()
    return [("train", mine[i: i + per]) for i in range(0, per_rank, per)]


def val_ids(val) -> list[tuple[str, list[int]]]:
    """The pair ids of this rank's validation micro-batches, every batch in order (as
    `ValidationRows` reads them)."""
    from rayzero.data.preferences import EMPTY

    per_rank, per = val.rows_per_rank // 2, val.micro_batch // 2
    out = []
    for batch in range(val.num_batches):
        first = batch * (val.global_batch // 2) + val.dp_rank * per_rank
        ids = [i if i < val.num_rows else EMPTY for i in range(first, first + per_rank)]
        out += [("val", ids[i: i + per]) for i in range(0, per_rank, per)]
    return out
