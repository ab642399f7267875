"""A step's micro-batches on one rank: one runner per kind of step, chosen at setup.

    runner      phases of the iteration graph       what runs the micro-batches
    Plain       forward, backward (per micro-batch)  the model, one micro-batch at a time
    Staged      pipeline                             this rank's pipeline stages, in its schedule's
                                                     order (`pipeline/runner.py`)

Inside either, the objective's part on the rank (`objectives/base.py`'s `RankObjective`) gives
each micro-batch's part of the step's mean loss, the same call from both runners: begun with the
step's micro-batches (it starts the all-reduce of its divisor), asked each micro-batch's loss
(on the last stage, in a pipeline), and asked the step's sums at the end. A runner adds the
model's auxiliary loss (a router's, one per micro-batch), averaged over the step's micro-batches
and weighted by its coefficient, and knows nothing else of the objective. With context
parallelism (`parallel.cp`) the runner keeps this rank's tokens of each row (`MicroBatch.split`)
before anything counts them; the objective sees the whole rows too (a loss over whole sequences
counts its completions there).

A runner is handed what it needs at setup (`StepContext`), never the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayzero.data.microbatch import MicroBatch

Micro = list[MicroBatch]


@dataclass(frozen=True)
class StepContext:
    """What a rank's runner and objective run with, built once at setup: the model and its seam,
    the strategy its backward goes through, the mesh, the device, dropout's streams, the
    activation meter, the vocabulary shard (tensor parallelism's split head, or None), the
    pipeline (None without stages), the context-parallel split (None without cp), the data and
    validation rows, and what the step's divisor needs known (`tokens_per_step`, `masks_labels`)."""

    model: torch.nn.Module
    spec: object
    strategy: object
    mesh: object
    device: torch.device
    streams: object
    meter: object
    vocab: object
    pipe: object
    cp: object
    data: object
    val: object
    reference: object  # the model the objective compares with (`workers/reference.py`), or None
    micro_per_step: int
    tokens_per_step: int
    masks_labels: bool

    @property
    def loss_axis(self):
        return self.mesh.axis("loss")


@dataclass
class StepTotals:
    """One step's sums on this rank, as the step's result reports them."""

    loss_sum: float
    tokens: int | float  # what the loss is divided by (valid targets, pairs, ...)
    metrics: dict  # the objective's, {"sum": ..., "max": ...}
    aux_sum: float
    z_sum: float | None = None  # a router z-loss's, over the step's micro-batches (`moe.router_z_loss`)

    def report(self, counts: bool, with_aux: bool, aux_counts: bool | None = None) -> dict:
        """What the step's result carries (`counts`: whether this rank's sums count: one rank per
        tensor-parallel group, in the last stage; the others report zeros; `aux_counts`: the same
        for the auxiliary loss, which every rank of a cp group computes whole)."""
        aux_counts = counts if aux_counts is None else aux_counts
        tokens = float(self.tokens)  # a count of targets or pairs; an objective's own count may be any number
        return {"loss_sum": float(self.loss_sum) if counts else 0.0,
                "tokens": (int(tokens) if tokens.is_integer() else tokens) if counts else 0,
                "aux_loss_sum": (float(self.aux_sum) if aux_counts else 0.0) if with_aux else None,
                "z_loss_sum": (self.z_sum if aux_counts else 0.0) if self.z_sum is not None else None,
                "objective": self.metrics if counts else {"sum": {}, "max": {}}}


class Plain:
    """Micro-batch by micro-batch: the iteration graph's forward and backward phases."""

    phases = ("forward", "backward")

    def __init__(self, ctx: StepContext, objective):
        self.ctx, self.objective = ctx, objective
        self.micro: Micro = []
        self.next = 0
        self.micro_per_step = ctx.micro_per_step
        self.checked = False  # the first forward checks the model's output
        self.activations_peak = 0
        self._aux_sum: torch.Tensor | None = None
        self._loss = None
        self.aux_coef = ctx.spec.aux_coef

    def begin(self, micro: Micro, rows: Micro, step: int, first_micro: int) -> None:
        """Step `step` on this rank's `micro` (on the device; `rows`: the same on the host),
        the step's micro-batches from `first_micro` on."""
        micro = [self.objective.prepare(b) for b in micro]  # the objective's own fields, on whole rows
        whole = micro  # a loss over whole sequences counts its rows there
        cp = self.ctx.cp
        if cp is not None:  # the cp group's ranks took the same rows: each keeps its tokens of them
            micro, rows = ([b.split(cp) for b in m] for m in (micro, rows))
        self.micro, self.next, self.step, self.first = micro, 0, step, first_micro
        # the step's micro-batches over every rank: fewer when the step brought fewer rows (rollouts)
        self.micro_per_step = self.ctx.micro_per_step
        if getattr(self.ctx.data, "whole_steps", None) is not None:
            self.micro_per_step = self.ctx.micro_per_step * len(micro) // self.ctx.data.num_microbatches
        self._aux_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        self.objective.begin(micro, rows, step, whole)

    def mean(self, loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """A micro-batch's part of the step's loss (the objective's, divided already), plus the
        model's auxiliary loss averaged over the step's micro-batches (the same at any world
        size) and weighted by its coefficient."""
        return loss if aux is None else loss + self.aux_coef * aux / self.micro_per_step

    def forward(self) -> None:
        ctx = self.ctx
        if self.next >= len(self.micro):  # a step of fewer micro-batches than the iteration has phases for
            return
        batch = self.micro[self.next]
        ctx.streams.begin(self.step, self.first + self.next)
        with ctx.meter.sampled(tuple(batch.tokens.shape)):  # what this micro-batch's forward leaves saved for its backward
            loss, aux = self.objective.loss(ctx.model, batch, not self.checked, self.next)
        self.activations_peak = max(self.activations_peak, ctx.meter.bytes)
        self.checked = True
        if aux is not None:
            self._aux_sum += aux.detach().double()
        self._loss = self.mean(loss, aux)

    def backward(self) -> None:
        if self.next >= len(self.micro):
            return
        last = self.next == len(self.micro) - 1
        self.ctx.strategy.backward(self._loss, last_microbatch=last)
        self._loss = None
        self.next += 1

    def check_done(self) -> None:
        """A RuntimeError unless every micro-batch has run (before the gradients are reduced)."""
        if self.next != len(self.micro):
            raise RuntimeError(f"ran {self.next} of {len(self.micro)} micro-batches")

    def end(self) -> StepTotals:
        """The step's sums, after its update."""
        done = self.objective.end()
        return StepTotals(done.loss_sum, done.count, done.metrics, self._aux_sum)

    def validate(self, val):
        """The objective's sums over this rank's validation rows, forward only (`StepSums`)."""
        return self.objective.validate(val)

    def memory(self) -> dict[str, int]:
        """The activations' peak, and what the objective holds (a reference model)."""
        return {"activations_peak": self.activations_peak, **self.objective.memory()}


class Staged(Plain):
    """Every micro-batch's forward and backward through this rank's pipeline stages, in the order
    its schedule gives (`pipeline/runner.py`): the iteration graph's pipeline phase."""

    phases = ("pipeline",)

    def __init__(self, ctx: StepContext, objective):
        super().__init__(ctx, objective)
        self.in_flight_peak = 0

    def run(self, times: dict[str, float]) -> None:
        self.objective.ready()  # every stage waits for the divisor's all-reduce, which only the last uses
        done = self.ctx.pipe.iteration(self.micro, self.step, self.first, self.objective, self.mean)
        self._aux_sum += done.aux_sum
        for k in ("forward", "backward"):
            times[k] += done.times[k]
        times["pipeline_wait"] = done.times["wait"]  # waiting on the other stages: the bubble
        self.activations_peak = max(self.activations_peak, done.activations_peak)
        self.in_flight_peak = max(self.in_flight_peak, done.in_flight_peak)
        self.next = len(self.micro)

    def memory(self) -> dict[str, int]:
        return {**super().memory(), "activations_in_flight": self.in_flight_peak}


def runner_for(ctx: StepContext, objective) -> Plain:
    """The rank's runner: staged with pipeline stages, plain otherwise."""
    return (Staged if ctx.pipe is not None else Plain)(ctx, objective)
