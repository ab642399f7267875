"""A step's micro-batches on one rank: one runner per kind of step, chosen at setup.

    runner      phases of the iteration graph       what runs the micro-batches
    Plain       forward, backward (per micro-batch)  the model, one micro-batch at a time
    Pipelined   pipeline                             this rank's stages, in its schedule's order
                                                     (`pipeline/runner.py`)

and, inside either, the objective, which gives each micro-batch's loss and the step's sums:

    objective       a micro-batch's loss                      divided by
    LanguageModel   cross-entropy summed over valid targets   the step's valid targets, over the
                                                              `loss` role's ranks
    Preference      the pair loss over its pairs              the step's pairs (its own divisors,
                    (`workers/preference.py`)                 also over the `loss` role)

The runner owns the step's `StepTotals` (the loss and router-loss sums, the valid targets or
pairs, the preference metrics), kept on the device until the step ends and read once there.
Normalisation is written once (`StepMean`, which both runners apply to each micro-batch's loss,
with the objective's divisor): summed over micro-batches and ranks, the gradient
is the mean loss's over the global batch, whatever the world size and however the masked targets
fall. With context parallelism (`parallel.cp`) the `loss` role spans the cp ranks too, and the
runner keeps this rank's tokens of each row (`ContextParallel.split`) before anything counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from rayzero.data.microbatch import MicroBatch
from rayzero.models.spec import IGNORE_INDEX
from rayzero.sharding.comm import wait
from rayzero.workers.assembly import context_of

if TYPE_CHECKING:
    from rayzero.workers.rank import Rank

Micro = list[MicroBatch]


@dataclass
class StepTotals:
    """One step's sums on this rank (device tensors until `report`)."""

    loss_sum: torch.Tensor
    aux_sum: torch.Tensor
    tokens: int | torch.Tensor = 0  # valid targets (or pairs)
    prefs: dict | None = None  # preference tuning's metrics' sums
    z_sum: float | None = None  # a router z-loss's, over the step's micro-batches (`moe.router_z_loss`)

    @classmethod
    def zeros(cls, device: torch.device) -> "StepTotals":
        return cls(torch.zeros((), dtype=torch.float64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device))

    def report(self, counts: bool, with_aux: bool, aux_counts: bool | None = None) -> dict:
        """What the step's result carries (`counts`: whether this rank's sums count: one rank per
        tensor-parallel group, in the last stage; the others report zeros; `aux_counts`: the same
        for the auxiliary loss, which every rank of a cp group computes whole)."""
        aux_counts = counts if aux_counts is None else aux_counts
        out = {"loss_sum": float(self.loss_sum) if counts else 0.0,
               "tokens": int(self.tokens) if counts else 0,
               "aux_loss_sum": (float(self.aux_sum) if aux_counts else 0.0) if with_aux else None,
               "z_loss_sum": (self.z_sum if aux_counts else 0.0) if self.z_sum is not None else None}
        if self.prefs is not None:
            out["prefs"] = self.prefs if counts else {}
        return out


@dataclass(frozen=True)
class StepMean:
    """A micro-batch's part of the step's mean loss: its loss over the objective's divisor (the
    step's valid targets summed over the `loss` role; 1 for a loss that divides itself), plus the
    model's auxiliary loss (a router's, one per micro-batch) averaged over the step's micro-batches
    (the same at any world size) and weighted by its coefficient."""

    divisor: Callable[[], float]  # waited for at the first use: the count's all-reduce overlaps
    aux_coef: float
    micro_per_step: int

    def __call__(self, loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        loss = loss / self.divisor()
        return loss if aux is None else loss + self.aux_coef * aux / self.micro_per_step


# -- objectives ----------------------------------------------------------------------------------
class LanguageModel:
    """Cross-entropy over the valid targets (not IGNORE_INDEX), divided by the step's count of
    them: known up front for plain text, else counted in this rank's rows on the host (nothing
    waits for the device) and summed over the `loss` role by an all-reduce started at the
    step's start and waited for at the first forward (queued behind any parameter all-gather in
    flight, so it costs no overlap)."""

    def __init__(self, rank: Rank):
        self.r = rank
        self._divisor: float | torch.Tensor = 1.0
        self._work = None

    def begin(self, micro: Micro, rows: Micro, step: int, whole: Micro) -> None:
        r = self.r
        self._work, self._divisor = None, float(r.data.tokens_per_step)
        if r.data.masks_labels:
            local = sum(int((b.targets != IGNORE_INDEX).sum()) for b in rows)
            self._divisor = torch.tensor([float(local)], dtype=torch.float64, device=r.device)
            self._work = r.mesh.axis("loss").start_all_reduce(self._divisor)

    def divisor(self) -> float:
        if self._work is not None:
            wait(self._work)
            self._work = None
        if isinstance(self._divisor, torch.Tensor):
            self._divisor = max(float(self._divisor.item()), 1.0)
        return self._divisor

    def loss(self, batch: MicroBatch, check: bool, index: int, totals: StepTotals):
        """(micro-batch `index`'s loss summed over its valid targets, the model's auxiliary loss or None)."""
        r = self.r
        loss_sum, valid, aux = r.spec.loss(r.model, batch, check=check, vocab=r.vocab)
        totals.loss_sum += loss_sum.detach()
        totals.tokens += valid.detach() if isinstance(valid, torch.Tensor) else valid  # no wait for the device
        return loss_sum, aux

    def end(self, totals: StepTotals) -> None:
        """Nothing to add: the sums are in place."""

    def validation_loss(self, val) -> tuple:
        """(summed loss, valid targets) over this rank's validation rows, forward only."""
        r = self.r
        if r._pipe is not None:
            from rayzero.workers import pipelined

            return pipelined.validation_loss(r._pipe, val, r.device, context_of(r.cfg, r.mesh))
        loss_sum, count = torch.zeros((), dtype=torch.float64, device=r.device), 0
        cp = context_of(r.cfg, r.mesh)
        for k in range(val.num_batches):
            for batch in val.microbatches(k):
                if cp is not None:
                    batch = batch.split(cp)
                part, valid, _ = r.spec.loss(r.model, batch.to(r.device), vocab=r.vocab)
                loss_sum += part.double()
                count += int(valid)
        return loss_sum, count


class Preference:
    """The pair loss (`workers/preference.py`'s step): it divides itself by the step's pairs, and
    its sums (the loss per pair, the pairs, the metrics) replace the language model's at the end."""

    def __init__(self, rank: Rank):
        self.r = rank

    def begin(self, micro: Micro, rows: Micro, step: int, whole: Micro) -> None:
        self.r.prefs.begin(micro, step, whole)

    def divisor(self) -> float:
        return 1.0

    def loss(self, batch: MicroBatch, check: bool, index: int, totals: StepTotals):
        return self.r.prefs.forward(batch, check, index)

    def end(self, totals: StepTotals) -> None:
        prefs = self.r.prefs.totals()
        totals.loss_sum.fill_(prefs.get("loss", 0.0))  # the loss summed per pair, over the pairs: the mean
        totals.tokens = int(prefs.get("pairs", 0))
        totals.prefs = prefs

    def validation_loss(self, val) -> tuple:
        prefs = self.r.prefs.evaluate()
        return prefs.get("loss", 0.0), int(prefs.get("pairs", 0)), prefs


# -- runners -------------------------------------------------------------------------------------
class Plain:
    """Micro-batch by micro-batch: the iteration graph's forward and backward phases."""

    phases = ("forward", "backward")

    def __init__(self, rank: Rank, objective):
        self.r, self.objective = rank, objective
        self.micro: Micro = []
        self.next = 0
        self.checked = False  # the first forward checks the model's output
        self.activations_peak = 0
        self.totals: StepTotals | None = None
        self._loss = None
        self.mean = StepMean(objective.divisor, rank.spec.aux_coef, rank.micro_per_step)
        self.cp = context_of(rank.cfg, rank.mesh)  # this rank's part of each sequence, with parallel.cp

    def begin(self, micro: Micro, rows: Micro, step: int, first_micro: int) -> None:
        """Step `step` on this rank's `micro` (on the device; `rows`: the same on the host),
        the step's micro-batches from `first_micro` on."""
        whole = micro  # a pair loss counts its pairs' whole completions
        if self.cp is not None:  # the cp group's ranks took the same rows: each keeps its tokens of them
            micro, rows = ([b.split(self.cp) for b in m] for m in (micro, rows))
        self.micro, self.next, self.step, self.first = micro, 0, step, first_micro
        self.totals = StepTotals.zeros(self.r.device)
        self.objective.begin(micro, rows, step, whole)

    def forward(self) -> None:
        r = self.r
        batch = self.micro[self.next]
        r.streams.begin(self.step, self.first + self.next)
        with r.meter.sampled(tuple(batch.tokens.shape)):  # what this micro-batch's forward leaves saved for its backward
            loss, aux = self.objective.loss(batch, not self.checked, self.next, self.totals)
        self.activations_peak = max(self.activations_peak, r.meter.bytes)
        self.checked = True
        if aux is not None:
            self.totals.aux_sum += aux.detach().double()
        self._loss = self.mean(loss, aux)

    def backward(self) -> None:
        last = self.next == len(self.micro) - 1
        self.r.strategy.backward(self._loss, last_microbatch=last)
        self._loss = None
        self.next += 1

    def check_done(self) -> None:
        """A RuntimeError unless every micro-batch has run (before the gradients are reduced)."""
        if self.next != len(self.micro):
            raise RuntimeError(f"ran {self.next} of {len(self.micro)} micro-batches")

    def end(self) -> StepTotals:
        """The step's sums, after its update."""
        self.objective.end(self.totals)
        return self.totals

    def memory(self) -> dict[str, int]:
        return {"activations_peak": self.activations_peak}


class Pipelined(Plain):
    """Every micro-batch's forward and backward through this rank's stages, in the order its
    schedule gives (`pipeline/runner.py`): the iteration graph's pipeline phase."""

    phases = ("pipeline",)

    def __init__(self, rank: Rank, objective):
        super().__init__(rank, objective)
        self.in_flight_peak = 0

    def run(self, times: dict[str, float]) -> None:
        r = self.r
        self.objective.divisor()  # every stage waits for the count's all-reduce, which only the last uses
        done = r._pipe.iteration(self.micro, self.step, self.first, self.mean)
        t = self.totals
        t.loss_sum += done.loss_sum
        t.aux_sum += done.aux_sum
        t.tokens += done.tokens
        for k in ("forward", "backward"):
            times[k] += done.times[k]
        times["pipeline_wait"] = done.times["wait"]  # waiting on the other stages: the bubble
        self.activations_peak = max(self.activations_peak, done.activations_peak)
        self.in_flight_peak = max(self.in_flight_peak, done.in_flight_peak)
        self.next = len(self.micro)

    def memory(self) -> dict[str, int]:
        return {"activations_peak": self.activations_peak, "activations_in_flight": self.in_flight_peak}


def runner_for(rank: Rank) -> Plain:
    """The rank's runner: pipelined with stages, plain otherwise; the objective the run trains."""
    objective = Preference(rank) if rank.prefs is not None else LanguageModel(rank)
    return (Pipelined if rank._pipe is not None else Plain)(rank, objective)
