"""A rank's side of preference tuning (`train.objective=dpo`): the reference model's sequence
log-probabilities, and each micro-batch's loss over its pairs (`objectives/dpo.py`).

The reference, by what the run trains:
    full fine-tuning   a frozen copy of the starting weights, built by the same assembly and
                       sharded by the same strategy: compute dtype, no gradient, no main copy,
                       no optimizer state (`FrozenCopy`);
    LoRA               no copy: the policy itself with its adapters switched off, as TRL does
                       with PEFT (`AdaptersOff`);
    dpo.precompute_ref every pair's log-probabilities computed once, before training, by one of
                       the above, which is then dropped (`Precomputed`).
The reference runs forward only, in eval mode (no dropout: TRL's default), under no_grad.

With context parallelism (`cp`) the two rows of a pair are split alike (each rank of a cp group
holds its part of both), and a pair's loss is a function of whole sequences: each rank sums its
tokens' log-probabilities per row, the sums are added over the cp group (`ContextParallel.whole`),
and every rank of the group computes the pair loss from the whole rows' sums and completion
token counts (counted in the unsplit rows). The group's ranks then hold the same loss and
metrics, which count once (the step's pairs are summed over the `batch` role, and one rank of
the cp group reports them); each rank's gradient is its own tokens' part of the loss's.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.nn as nn

from rayzero.data.microbatch import MicroBatch
from rayzero.objectives.dpo import PreferenceLoss, add_sums, as_floats, counts, row_tokens, sequence_logps
from rayzero.sharding.comm import wait


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """`model` in eval mode, under no_grad, for the span; back in training mode after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _logps(spec, vocab):
    """The model seam's sequence log-probabilities of a micro-batch: `last` of a forward-only pass."""
    return lambda m, b: sequence_logps(spec.token_losses(m, b, vocab=vocab)[0])


class FrozenCopy:
    """The starting weights, frozen, sharded like the policy (built by `assemble(frozen=True)`),
    split into the same pipeline stages (`stages`) when the policy is."""

    def __init__(self, spec, model: nn.Module, strategy, vocab, stages=None):
        self.spec, self.model, self.strategy, self.vocab = spec, model, strategy, vocab
        self.model.eval()
        self.runner = None
        if stages is not None:
            from rayzero.pipeline.stages import StageRunner

            self.runner = StageRunner(model, stages)

    def logps(self, batch: MicroBatch, pair_ids=None) -> torch.Tensor:
        with evaluating(self.model):
            per_token, _ = self.spec.token_losses(self.model, batch, vocab=self.vocab)
        self.strategy.after_forward_only()  # ZeRO-3: nothing left gathered
        return sequence_logps(per_token)

    def stage_logps(self, pipe, micro, ids=None) -> list[torch.Tensor]:
        """Through the pipeline, forward only: each micro-batch's on the last stage."""
        with evaluating(self.model):
            out = pipe.forward_only(micro, _logps(self.spec, self.vocab), self.runner)
        self.strategy.after_forward_only()
        return out

    def memory(self) -> dict[str, int]:
        return {"reference_params": self.strategy.memory()["frozen_params"]}


class AdaptersOff:
    """The policy with its LoRA adapters switched off: the base model, which LoRA never trains."""

    def __init__(self, spec, model: nn.Module, strategy, vocab):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.spec, self.model, self.strategy, self.vocab = spec, model, strategy, vocab
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    @contextlib.contextmanager
    def _off(self):
        for m in self.layers:
            m._disable_adapters = True  # not `enable_adapters(False)`, which would change requires_grad
        try:
            yield
        finally:
            for m in self.layers:
                m._disable_adapters = False

    def logps(self, batch: MicroBatch, pair_ids=None) -> torch.Tensor:
        with self._off(), evaluating(self.model):
            per_token, _ = self.spec.token_losses(self.model, batch, vocab=self.vocab)
        self.strategy.after_forward_only()
        return sequence_logps(per_token)

    def stage_logps(self, pipe, micro, ids=None) -> list[torch.Tensor]:
        with self._off(), evaluating(self.model):
            out = pipe.forward_only(micro, _logps(self.spec, self.vocab))
        self.strategy.after_forward_only()
        return out

    def memory(self) -> dict[str, int]:
        return {"reference_params": 0}


class Precomputed:
    """Every pair's reference log-probabilities, computed once before training by a reference
    that is then dropped (`dpo.precompute_ref`): a table per split ("train", "val") of
    [pairs, (chosen, rejected)], looked up by pair id (EMPTY: a filler pair, 0)."""

    def __init__(self, tables: dict[str, torch.Tensor]):
        self.tables = tables

    def logps(self, batch: MicroBatch, ids) -> torch.Tensor:
        split, pair_ids = ids
        table = self.tables[split]
        index = torch.as_tensor(pair_ids, dtype=torch.long, device=table.device)
        rows = table[index.clamp(min=0)].masked_fill((index < 0).unsqueeze(-1), 0.0)
        return rows.flatten().to(torch.float32)  # chosen, rejected, chosen, ...: the rows' order

    def stage_logps(self, pipe, micro, ids) -> list[torch.Tensor]:
        if not pipe.stages.last:
            return []
        return [self.logps(b, i) for b, i in zip(micro, ids)]

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
            got = (reference.stage_logps(pipe, micro) if pipe is not None
                   else [reference.logps(b) for b in micro])
            got = got if cp is None else [cp.whole(lp) for lp in got]
            for chunk, lp in zip(ids, got):
                if chunk:
                    index = torch.as_tensor(chunk, dtype=torch.long, device=device)
                    table[index] = lp.double().view(-1, 2)[: len(chunk)]
        wait(mesh.axis("batch").start_all_reduce(table))
        tables[name] = table
    return Precomputed(tables)


class PreferenceStep:
    """Each micro-batch's preference loss on this rank: the step's divisors (its pairs and
    chosen completion tokens over every rank, all-reduced once at the start of the step), the
    reference's log-probabilities, and the metrics' sums. In a pipeline (`pipe`), the last
    stage computes the loss (`pipe.objective`), and the reference's log-probabilities come from
    a forward-only pass through the stages before the step's schedule."""

    def __init__(self, cfg, spec, model, reference, mesh, device, vocab, pipe=None, data=None, val=None, cp=None):
        self.cfg, self.spec, self.model, self.reference = cfg, spec, model, reference
        self.mesh, self.device, self.vocab, self.pipe, self.cp = mesh, device, vocab, pipe, cp
        self.data, self.val = data, val  # the rank's training batches and validation rows
        self.loss = PreferenceLoss(cfg.dpo)
        self._divisors: tuple[float, float] | torch.Tensor = (1.0, 1.0)
        self._work = None
        self._refs: list | None = None  # in a pipeline: the step's reference log-probabilities, per micro-batch
        self.sums: dict[str, torch.Tensor] = {}  # this step's, on the device until `totals`
        self._tokens: list[torch.Tensor] = []  # each micro-batch's rows' completion tokens (whole rows)
        if pipe is not None:
            pipe.objective = lambda m, b, check, micro: self._loss_of(m, b, check, self._refs[micro], micro)

    @property
    def _precomputed(self) -> bool:
        return isinstance(self.reference, Precomputed)

    def begin(self, micro: list[MicroBatch], step: int, whole=None) -> None:
        """Step `step` starts on `micro` (with cp, this rank's part of the rows of `whole`):
        count its pairs in the whole rows (summed over the data-parallel ranks, waited for at
        the first forward) and clear the sums; in a pipeline, the reference's pass through the
        stages."""
        self._tokens = [row_tokens(b.targets) for b in (whole or micro)]
        self._divisors = torch.stack([counts(b.targets, n) for b, n in zip(micro, self._tokens)]).sum(0)
        self._work = self.mesh.axis("batch").start_all_reduce(self._divisors)
        self.sums = {}
        self._ids = step_ids(self.data, step) if self._precomputed else None
        ids = self._ids
        if self.pipe is not None:
            self._refs = self.references(micro, ids)

    def totals(self) -> dict[str, float]:
        """The step's sums as numbers: the loss summed per pair, the pairs, each metric's sum."""
        return as_floats(self.sums)

    def references(self, micro, ids) -> list:
        """The reference's log-probabilities of each micro-batch through the pipeline (on the
        last stage; None for each elsewhere, and without a reference)."""
        if self.reference is None:
            return [None] * len(micro)
        got = self.reference.stage_logps(self.pipe, micro, ids)
        return [self._whole_ref(r) for r in got] if got else [None] * len(micro)

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

    def _loss_of(self, model, batch: MicroBatch, check: bool, ref, index: int):
        """(micro-batch `index`'s part of the step's loss, 0, the auxiliary loss or None)."""
        per_token, aux = self.spec.token_losses(model, batch, check=check, vocab=self.vocab)
        loss, sums = self.loss(self._rows(per_token), batch.targets, ref, self.divisors(), self._tokens[index])
        add_sums(self.sums, sums)
        return loss, 0, aux

    def forward(self, batch: MicroBatch, check: bool, index: int):
        """(micro-batch `index`'s part of the step's loss, the model's auxiliary loss or None)."""
        ids = self._ids[index] if self._ids is not None else None
        ref = self._whole_ref(self.reference.logps(batch, ids)) if self.reference is not None else None
        loss, _, aux = self._loss_of(self.model, batch, check, ref, index)
        return loss, aux

    def evaluate(self) -> dict[str, float]:
        """The metrics' sums over this rank's validation rows, forward only; the loss summed per
        pair (the controller divides by the pairs)."""
        val = self.val
        whole = [b.to(self.device) for k in range(val.num_batches) for b in val.microbatches(k)]
        tokens = [row_tokens(b.targets) for b in whole]
        micro = whole if self.cp is None else [b.split(self.cp) for b in whole]
        ids = val_ids(val) if self._precomputed else [None] * len(micro)
        total: dict[str, torch.Tensor] = {}

        def last(m, batch, ref, n):
            per_token, _ = self.spec.token_losses(m, batch, vocab=self.vocab)
            divisors = counts(batch.targets, n).clamp(min=1.0).tolist()
            return self.loss(self._rows(per_token), batch.targets, ref, (divisors[0], divisors[1]), n)[1]

        if self.pipe is not None:
            refs = self.references(micro, ids)
            queue = iter(zip(refs, tokens))
            with evaluating(self.model):
                for sums in self.pipe.forward_only(micro, lambda m, b: last(m, b, *next(queue))):
                    add_sums(total, sums)
            return as_floats(total)
        with evaluating(self.model):
            for b, i, n in zip(micro, ids, tokens):
                ref = self._whole_ref(self.reference.logps(b, i)) if self.reference is not None else None
                add_sums(total, last(self.model, b, ref, n))
        return as_floats(total)


def disable_dropout(model: nn.Module) -> None:
    """No dropout anywhere in `model`: its dropout modules at p=0 (TRL's `disable_dropout_in_model`),
    and the rates attention modules keep as floats for their kernel (`attention_dropout`, `dropout`)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)


def start(cfg, spec, model, strategy, mesh, device, streams, vocab, pipe=None, data=None, val=None,
          cp=None) -> PreferenceStep:
    """This rank's preference tuning: its reference (none for a reference-free loss) and loss;
    `data`, `val`: the rank's training batches and validation rows (or None); `cp`: the rank's
    `ContextParallel`, or None."""
    if cfg.dpo.disable_dropout:  # TRL's default: the policy's log-probabilities without dropout's noise
        disable_dropout(model)
    reference = None
    if cfg.dpo.uses_reference:
        if cfg.model.lora is not None:
            reference = AdaptersOff(spec, model, strategy, vocab)
        else:
            from rayzero.workers.assembly import assemble

            ref_model, ref_strategy, _, ref_stages = assemble(cfg, spec, mesh, device, streams, frozen=True)
            ref_vocab = ref_strategy.tp.vocab if ref_strategy.tp is not None else None
            reference = FrozenCopy(spec, ref_model, ref_strategy, ref_vocab, ref_stages)
        if cfg.dpo.precompute_ref:  # every pair's once, now; the reference model is dropped after
            reference = precompute(reference, pipe, mesh, device, splits_of(data, val), cfg.train.micro_batch_size, cp)
            gc.collect()
    return PreferenceStep(cfg, spec, model, reference, mesh, device, vocab, pipe, data, val, cp)


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
