"""One rank's part of a pipelined iteration: its schedule's actions, run in order.

    RECV_F  post the receive of a chunk's input activations (from the stage before)
    F       the chunk's forward (`StageRunner`); on the last stage, the loss
    SEND_F  send its output activations to the stage after
    RECV_B  post the receive of the gradient of those outputs
    B       backward through the chunk (I then W: the input gradient first, the weights' later)
    SEND_B  send the input gradient to the stage before

Sends and receives are point-to-point on the pipeline group, tagged by the boundary they cross,
of shapes known ahead (micro-batch x sequence (its TP shard with sequence parallelism) x hidden,
in the compute dtype; with a mixture of experts' router loss, also the router logits of every
layer so far, `models/routers.py`); a send returns at once, a receive is waited for by the
compute that needs it. The backward goes through the strategy, so every sharding strategy's gradient
reduction and ZeRO-3's gathers work inside a stage as they do without a pipeline. The W part of
`zero_bubble` uses torch's split backward (`torch.distributed.pipelining`), and gives the weight
gradients to the strategy as they land.

For measuring (benchmarks/pipeline.py): `Link.sent_bytes` counts the bytes this rank has sent,
and `PipelineRun.trace`, off unless set to a list, records each compute action's start and end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rayzero.pipeline.schedules import Action
from rayzero.pipeline.stages import StageRunner, Stages


RECV_AHEAD = 2  # receives a rank keeps posted: the one its next compute waits for and the one after


@dataclass
class Link:
    """The pipeline group's point-to-point messages for this rank: peers by stage, tags by boundary."""

    stages: Stages
    rank_of_stage: list[int]  # global rank holding each stage, on this rank's (replicate, shard, tp)
    tokens: int = 0  # a row's tokens on this rank (its cp and SP share): the router logits' rows per micro-batch row
    sent_bytes: int = 0  # every tensor this rank has sent, since it was made

    def tag(self, boundary: int, micro: int, backward: bool, part: int = 0) -> int:
        """Part `part` of what crosses the boundary between stage `boundary` and the next, for `micro`, either way."""
        return ((((micro * self.stages.plan.num_stages + boundary) << 1) | int(backward)) << 1) | part

    def send(self, ts: list[torch.Tensor], stage: int, boundary: int, micro: int, backward: bool) -> list:
        self.sent_bytes += sum(t.numel() * t.element_size() for t in ts)
        return [dist.isend(t.contiguous(), self.rank_of_stage[stage], tag=self.tag(boundary, micro, backward, i))
                for i, t in enumerate(ts)]

    def recv(self, outs: list[torch.Tensor], stage: int, boundary: int, micro: int, backward: bool) -> list:
        return [dist.irecv(t, self.rank_of_stage[stage], tag=self.tag(boundary, micro, backward, i))
                for i, t in enumerate(outs)]


@dataclass
class Totals:
    """What one iteration's pipeline leaves for the step's report."""

    aux_sum: torch.Tensor  # the model's auxiliary loss (a router's), summed over the micro-batches
    times: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0, "wait": 0.0})
    activations_peak: int = 0  # the most one chunk's forward left saved
    in_flight_peak: int = 0  # the most all forwards not yet backward held at once


@dataclass(frozen=True)
class PipeContext:
    """What a rank's pipeline runs with: its model and the model seam, the strategy its backward
    goes through, its stages, the link to its peers and its schedule's actions, the boundary's
    shape and dtype (`workers/stages.py` makes them from the mesh and the model seam), and the
    rank's dropout streams, activation meter and vocabulary shard."""

    model: torch.nn.Module
    spec: object
    strategy: object
    stages: Stages
    link: Link
    actions: list[Action]
    shape: tuple[int, ...]  # what crosses a boundary: (micro-batch, sequence (its TP shard with SP), hidden)
    dtype: torch.dtype
    device: torch.device
    streams: object
    meter: object
    vocab: object = None
    routers: object = None  # a mixture of experts' router logits, passed on with the activations


class PipelineRun:
    """A rank's pipeline: runs its actions for each iteration's micro-batches (`iteration`), and
    micro-batches forward only through its stages for evaluation (`forward_only`)."""

    def __init__(self, ctx: PipeContext):
        self.ctx = ctx
        self.model, self.spec, self.strategy = ctx.model, ctx.spec, ctx.strategy
        self.stages, self.link, self.actions = ctx.stages, ctx.link, ctx.actions
        self.shape, self.dtype, self.device = ctx.shape, ctx.dtype, ctx.device
        self.routers = ctx.routers
        self.progress = lambda: None  # called at each action: a rank's watchdog sees a long schedule move
        self.streams, self.meter, self.vocab = ctx.streams, ctx.meter, ctx.vocab
        self.runner = StageRunner(ctx.model, ctx.stages)
        self.checked = False
        # Off (None) unless a caller sets a list: then each F, B, I and W appends (str(action),
        # start, end) in time.perf_counter() seconds, a receive's wait left out of its start.
        self.trace: list[tuple[str, float, float]] | None = None
        # The action after which no more weight gradients land on this rank: the strategy may
        # start its last reductions there. (The first stage has no input gradient to split off:
        # its I is the whole backward and its W nothing, as torch's pipelining does.)
        self._full_at_i = ctx.stages.first
        landing = [i for i, a in enumerate(ctx.actions)
                   if a.op == "B" or a.op == ("I" if self._full_at_i else "W")]
        self._last_backward = landing[-1]

    # -- one iteration -------------------------------------------------------------------
    def iteration(self, micro, step: int, first_micro: int, objective, mean) -> Totals:
        """Every action of this rank's schedule over `micro` (its `MicroBatch`es). On the last
        stage, `objective.loss(model, batch, check, index)` gives a micro-batch's part of the
        step's loss and the model's auxiliary loss (the objective's part on the rank,
        `objectives/base.py`, as the plain runner calls it); `mean` adds the auxiliary loss (the
        step runner's, the one normalisation)."""
        totals = Totals(torch.zeros((), dtype=torch.float64, device=self.device))
        self._objective = objective
        self._inputs: dict = {}  # (micro, chunk) -> received activations (the leaf whose grad goes back)
        self._outputs: dict = {}  # (micro, chunk) -> output activations, or the scaled loss
        self._recvs: dict = {}  # (op, micro, chunk) -> pending receive
        self._ahead = iter([a for a in self.actions if a.op in ("RECV_F", "RECV_B")])
        self._groups: dict = {}  # (micro, chunk) -> zero_bubble's weight-gradient groups
        self._saved: dict = {}  # (micro, chunk) -> bytes its forward left saved
        sends = []
        for index, a in enumerate(self.actions):
            self.progress()
            t0 = time.perf_counter()
            s = self.stages.chunks[a.chunk]
            if a.op in ("RECV_F", "RECV_B"):
                # Posted ahead, in the schedule's order (as NCCL matches them): the message can land
                # while this rank computes, and posting is off the path of the compute that waits.
                while (a.op[-1], a.micro, a.chunk) not in self._recvs or len(self._recvs) < RECV_AHEAD:
                    if not self._post(next(self._ahead, None)):
                        break
            elif a.op == "SEND_F":
                outs = [t.detach() for t in self._outputs[a.micro, a.chunk]]
                sends.append((outs, self.link.send(outs, s + 1, s, a.micro, False)))
            elif a.op == "SEND_B":
                grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                         for t in self._inputs.pop((a.micro, a.chunk))]
                sends.append((grads, self.link.send(grads, s - 1, s - 1, a.micro, True)))
            elif a.op == "F":
                self._forward(a, micro, step, first_micro, mean, totals)
                self._record(a, t0)
                totals.times["forward"] += time.perf_counter() - t0
                continue
            else:
                self._backward(a, last=index == self._last_backward, totals=totals)
                self._record(a, t0)
                totals.times["backward"] += time.perf_counter() - t0
                continue
            totals.times["wait"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        for _, works in sends:
            for work in works:
                work.wait()
        totals.times["wait"] += time.perf_counter() - t0
        return totals

    # -- forward only ----------------------------------------------------------------------
    def forward_only(self, micro, last, runner: StageRunner | None = None) -> list:
        """Each micro-batch of `micro` forward only through this rank's chunks of `runner`'s model
        (the pipeline's own by default, or a reference model split the same way), in stage order,
        receiving from the stage before and sending to the one after: what `last(model, batch)`
        gives for each micro-batch on the last stage, in order (nothing elsewhere). Evaluation
        and preference tuning's reference pass use it."""
        runner = runner or self.runner
        stages, link = self.stages, self.link
        out = []
        for index, batch in enumerate(micro):
            for c, s in enumerate(stages.chunks):
                received = None
                if not stages.is_first(c):
                    received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                    for work in link.recv([received], s - 1, s - 1, index, False):
                        work.wait()
                if stages.is_last(c):
                    out.append(runner.run(c, received, lambda m: last(m, batch)))
                else:
                    hidden = runner.run(c, received, lambda m: self.spec.logits(m, batch))
                    for work in link.send([hidden], s + 1, s, index, False):
                        work.wait()
        return out

    def _post(self, a: Action | None) -> bool:
        """Post the receive of RECV action `a` (None: there is none left)."""
        if a is None:
            return False
        s = self.stages.chunks[a.chunk]
        if a.op == "RECV_F":
            bufs = self.boundary(s - 1)
            self._recvs["F", a.micro, a.chunk] = (bufs, self.link.recv(bufs, s - 1, s - 1, a.micro, False))
        else:
            bufs = self.boundary(s)
            self._recvs["B", a.micro, a.chunk] = (bufs, self.link.recv(bufs, s + 1, s, a.micro, True))
        return True

    def boundary(self, b: int) -> list[torch.Tensor]:
        """Empty tensors for what crosses boundary `b` (after stage `b`): the activations, and
        with routers every layer's router logits up to there."""
        out = [torch.empty(self.shape, dtype=self.dtype, device=self.device)]
        if self.routers is not None:
            layers = sum(self.stages.routers_in[: b + 1])
            tokens = self.shape[0] * self.link.tokens
            out.append(torch.empty(layers, tokens, self.routers.experts, dtype=self.dtype, device=self.device))
        return out

    def _record(self, a: Action, t0: float) -> None:
        if self.trace is not None:
            self.trace.append((str(a), t0 + self._wait_s, time.perf_counter()))

    def _received(self, kind: str, a: Action) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        bufs, works = self._recvs.pop((kind, a.micro, a.chunk))
        for work in works:
            work.wait()
        self._wait_s += time.perf_counter() - t0
        return bufs

    def _forward(self, a: Action, micro, step, first_micro, mean, totals: Totals) -> None:
        batch = micro[a.micro]
        self._wait_s = 0.0
        received = []
        if not self.stages.is_first(a.chunk):
            received = [t.requires_grad_() for t in self._received("F", a)]
            self._inputs[a.micro, a.chunk] = received
        # Each stage's dropout draws from streams of (step, micro-batch, stage): the same draws
        # at any pipeline schedule, data-parallel size or resume.
        self.streams.begin(step, first_micro + a.micro, self.stages.chunks[a.chunk])
        last = self.stages.is_last(a.chunk)
        hidden = received[0] if received else None
        if self.routers is not None:
            self.routers.recording = []
        with self.meter.sampled((a.chunk, tuple(batch.tokens.shape))):
            if last:
                out = self.runner.run(a.chunk, hidden, lambda m: self._objective.loss(
                    m, batch, not self.checked, a.micro))
            else:
                out = [self.runner.run(a.chunk, hidden, lambda m: self.spec.logits(m, batch))]
            if self.routers is not None:  # this stage's router logits after those of the stages before
                own = self.routers.recording
                logits = torch.cat([*received[1:], *(t.unsqueeze(0) for t in own)])
                self.routers.recording = None
                if last:
                    out = (out[0], self.routers.loss(logits))
                else:
                    out.append(logits)
        self.checked = True
        self._saved[a.micro, a.chunk] = self.meter.bytes
        totals.activations_peak = max(totals.activations_peak, self.meter.bytes)
        totals.in_flight_peak = max(totals.in_flight_peak, sum(self._saved.values()))
        if last:
            part, aux = out
            loss = mean(part, aux)
            if aux is not None:
                totals.aux_sum += aux.detach().double()
            out = [loss]
        self._outputs[a.micro, a.chunk] = out
        totals.times["wait"] += self._wait_s
        totals.times["forward"] -= self._wait_s

    def _backward(self, a: Action, last: bool, totals: Totals) -> None:
        self._wait_s = 0.0
        key = a.micro, a.chunk
        if a.op == "W":
            if self._full_at_i:
                return
            from torch.distributed.pipelining._backward import stage_backward_weight

            params, groups = self._groups.pop(key)
            self._saved.pop(key, None)  # what the weight gradients needed is freed now
            self.strategy.backward_weights(lambda: stage_backward_weight(iter(params), groups), params, last)
            return
        out = self._outputs.pop(key)
        grad = None if self.stages.is_last(a.chunk) else self._received("B", a)
        received = self._inputs.get(key, [])
        if a.op == "B" or (a.op == "I" and self._full_at_i):
            self.strategy.backward(out, last, grad=grad)
            self._saved.pop(key, None)
        else:  # "I": the input gradient now, the weights' in this chunk's W (its activations held until then)
            # imported here, not with this module: torch.distributed.pipelining (and torch._dynamo,
            # DTensor's ops with it) costs every rank process ~3 s of CPU at start
            from torch.distributed.pipelining._backward import stage_backward_input

            params = [p for p in self.model.parameters() if p.requires_grad]
            outs, grads = self.strategy.scaled(out, grad)
            _, groups = self.strategy.backward_inputs(
                lambda: stage_backward_input(outs, grads, received, iter(params)))
            self._groups[key] = (params, groups)
        totals.times["wait"] += self._wait_s
        totals.times["backward"] -= self._wait_s
