"""The sharding strategies: one `Strategy` that owns the flat buffers and drives the phases of
an iteration, composed of three small policies that one table chooses per strategy:

    strategy                    gradients               parameters    optimizer state
    no_shard            DDP     AllReduceAtEnd          WholeParams   OwnAll
    optim               ZeRO-1  ReduceScatterAtEnd      WholeParams   OwnShard
    optim_grads         ZeRO-2  ReduceScatterPerBucket  WholeParams   OwnShard
    optim_grads_params  ZeRO-3  ReduceScatterPerBucket  ShardedUnits  OwnShard

The policies, a file per column (grad_sync.py, placement.py with fsdp.py, ownership.py):

    gradients   AllReduceAtEnd: full gradient buckets, all-reduced once per step, as the last
                micro-batch's backward completes each; ReduceScatterAtEnd: the same, reduce-
                scattered; ReduceScatterPerBucket: each bucket reduce-scattered on every
                micro-batch as backward completes it, only the rank's shard of the sums kept
    parameters  WholeParams: whole on every rank, in the flat buffer; ShardedUnits: a shard at
                rest, each FSDP unit gathered around its forward and backward, then released
    ownership   OwnAll: AdamW on everything; OwnShard: AdamW on the rank's shard, then the
                updated shards all-gathered where parameters are whole at rest

Hybrid sharding (`dp_outer` > 1) shards within the "shard" axis and keeps the row, with the ownership
that `outer_strategy` names (HYBRID_OWNERSHIP): `no_shard` (HSDP) keeps OwnShard, whose gradient shards
are all-reduced across the "replicate" axis; `optim` (Hybrid-FSDP) takes OwnShardAcrossReplicas, which
splits each shard across the replicas too (reduce-scatter, then all-gather across them after the step).

The policies act on a bucket group (group.py: buckets reduced and sharded over one set of ranks,
keyed by dtype and dense or expert), one set of the row's policies per group; a model whose experts
the caller names (`experts`) gets an expert group beside the dense one, with the mesh's expert roles
as its axes. The strategy runs each phase over its groups.

Each policy has a start/finish pair: a bucket's gradient reduction (`grad_sync.start(bucket)`,
`grad_sync.finish()`), a unit's parameter all-gather (ShardedUnits), the all-gather of the updated
parameters after the step (`owner.start()`, `owner.finish(buckets)`). The phases of one iteration:

    begin_step()                 gather: zero gradients; wait for the parameter all-gather
                                 (or, overlapped, let forward wait bucket by bucket)
    backward(loss, last)         backward: gradient reductions start as buckets complete
    finish_grad_sync()           reduce_scatter: finish them, then the outer (hybrid) reduction,
                                 then the finalizers
    step(lr) -> grad_norm        step: clip by the global norm, AdamW, start the all-gather

The finalizers (finalize.py: `TiedSum`, `TPPartialSum`) are the model's gradient fix-ups after the
reduction, each chosen at build where it applies, not a branch in the step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from rayzero.sharding.adamw import AdamWHyper, FlatAdamW, merge_runs
from rayzero.sharding.comm import wait
from rayzero.sharding.config import OptimConfig, ShardingConfig
from rayzero.sharding.finalize import TiedSum, TPPartialSum, Tied
from rayzero.sharding.flat_buffer import Fill, FlatBuffer, ParamSource, as_source
from rayzero.sharding.fsdp import ShardedUnits
from rayzero.sharding.grad_sync import AllReduceAtEnd, ReduceScatterAtEnd, ReduceScatterPerBucket
from rayzero.sharding.group import ROLES, BucketGroup, GroupKey
from rayzero.sharding.layout import Bucket, Layout, Range
from rayzero.sharding.memory import MemoryLedger, nbytes
from rayzero.sharding.ownership import OwnAll, OwnShard, OwnShardAcrossReplicas
from rayzero.sharding.placement import WholeParams
from rayzero.sharding.precision import Precision, build_loss_scaler
from rayzero.sharding.tensor_parallel import TPLayout
from rayzero.sharding.mesh import Mesh


@dataclass(frozen=True)
class Row:
    """What one strategy is: its three policies."""

    grads: type  # how gradients are synchronized
    params: type  # where parameters live
    owner: type  # who owns the optimizer state


STRATEGIES: dict[str, Row] = {
    "no_shard":           Row(AllReduceAtEnd,         WholeParams,  OwnAll),    # DDP
    "optim":              Row(ReduceScatterAtEnd,     WholeParams,  OwnShard),  # ZeRO-1
    "optim_grads":        Row(ReduceScatterPerBucket, WholeParams,  OwnShard),  # ZeRO-2
    "optim_grads_params": Row(ReduceScatterPerBucket, ShardedUnits, OwnShard),  # ZeRO-3 / FSDP
}

# With `dp_outer` > 1: the ownership `outer_strategy` names, in place of the row's.
HYBRID_OWNERSHIP: dict[str, type] = {"no_shard": OwnShard, "optim": OwnShardAcrossReplicas}


@dataclass
class Sharded:
    """A bucket group and the row's policies built for it."""

    group: BucketGroup
    grad_sync: object
    placement: object
    owner: object

    @classmethod
    def build(cls, group: BucketGroup, model: nn.Module, sharding: ShardingConfig) -> "Sharded":
        row = STRATEGIES[sharding.strategy]
        grad_sync = row.grads(group)
        placement = row.params(group, model, grad_sync, tuple(sharding.fsdp_units))
        owner = HYBRID_OWNERSHIP[sharding.outer_strategy] if sharding.dp_outer > 1 else row.owner
        return cls(group, grad_sync, placement, owner(group, placement, model))


class Strategy:
    """The flat buffers (parameters, gradients, fp32 main copy, AdamW state) and the phases of an iteration
    over its bucket groups; what is sharded and when it is communicated is the policies' (the table above)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        sharding: ShardingConfig,
        optim: OptimConfig,
        decays: Callable[[str, torch.Tensor], bool] = lambda name, p: p.dim() >= 2,
        source: ParamSource | Fill | None = None,
        device: torch.device | str = "cpu",
        tp: TPLayout | None = None,
        tied: Tied | None = None,
        experts: frozenset[str] = frozenset(),
    ):
        """The strategy `sharding.strategy` names. `model` may be on the meta device when `source` gives each
        parameter's initial fp32 values (a `ParamSource`, or a `fill(name, out)` function); without it the
        model's current values are copied. Parameters with `requires_grad=False` stay frozen: they get buckets of
        their own, with no gradient, main copy or optimizer state. `tp`: what tensor parallelism split (the
        model's parameters are then this rank's local shards). `mesh`: a connected one (its groups) on a rank;
        its shape alone builds on the meta device. `tied`: a pipeline stage's parameters shared with another
        stage. `experts`: a model's expert parameters, a bucket group of their own."""
        self.name, self.model, self.mesh = sharding.strategy, model, mesh
        self.cfg, self.optim_cfg = sharding, optim
        self.tp = tp if tp is not None and (tp.size > 1 or tp.split) else None  # what TP (or ep) split
        self.tied = tied if tied is not None and tied.names else None
        self.pp_axis, self.tp_ranks = mesh.axis("pp"), mesh.size("tp")
        self.precision = Precision.from_config(sharding)
        self.scaler = build_loss_scaler(sharding)
        self.ledger = MemoryLedger()
        self.last_step_skipped = False

        alone = self.tied.names if self.tied else frozenset()
        device = torch.device(device)
        named, layout = self.layout(model, sharding, mesh.size("grad_reduce"), alone, experts, device.type == "cpu")
        self.buffer = FlatBuffer(model, named, layout, self.precision.param, device)
        self.groups = [Sharded.build(g, model, sharding) for g in self._bucket_groups(experts)]
        self._of = {b.index: part for part in self.groups for b in part.group.buckets}
        if source is None:
            values = {n: p.detach() for n, p in named}
            source = lambda name, out: out.copy_(values[name])  # noqa: E731
        source = as_source(source)
        self.grads: list[torch.Tensor] = []
        self.main_params: list[torch.Tensor] = []
        self.main_grads: list[torch.Tensor] = []
        for b in self.buffer.buckets:
            self._build_bucket(b, self.buffer.install(b, self._initial_values(b, source)))
        decaying = {i for i, n in enumerate(self.buffer.names) if decays(n, self.buffer.params[i])}
        hyper = AdamWHyper(optim.beta1, optim.beta2, optim.eps, optim.weight_decay)
        self.optimizer = FlatAdamW(self.main_params, hyper, self._decay_runs(decaying))
        self.ledger.hold("optimizer", 2 * nbytes(self.optimizer.exp_avg))

    @staticmethod
    def layout(model: nn.Module, sharding: ShardingConfig, dp_size: int, alone: frozenset[str] = frozenset(),
               experts: frozenset[str] = frozenset(), cpu: bool = False) -> tuple[list, Layout]:
        """The parameters in buffer order and the buckets they fall in: what the strategy builds (the dry run asks
        it of a model on meta). `alone`: parameters each in a bucket of their own (a pipeline's tied ones);
        `experts`: in buckets apart from the rest; `cpu`: for CPU ranks, to which `bucket_numel=auto` gives
        larger buckets."""
        return STRATEGIES[sharding.strategy].params.layout(model, sharding, dp_size, alone, experts, cpu)

    def _bucket_groups(self, experts: frozenset[str]) -> list[BucketGroup]:
        """The buffer's buckets by group key (no bucket mixes keys), each group with its axes."""
        by_key: dict[GroupKey, list[Bucket]] = {}
        for b in self.buffer.buckets:
            key = GroupKey(self.precision.param, self.buffer.names[b.params[0]] in experts)
            by_key.setdefault(key, []).append(b)
        return [BucketGroup(key, self.buffer, tuple(buckets), *(self.mesh.axis(r) for r in ROLES[key.expert]),
                            precision=self.precision, ledger=self.ledger,
                            overlap_grad_reduce=self.cfg.overlap_grad_reduce,
                            overlap_param_gather=self.cfg.overlap_param_gather)
                for key, buckets in by_key.items()]

    def _initial_values(self, b: Bucket, source: ParamSource) -> torch.Tensor:
        """The bucket's fp32 values. From a partial source (weights in storage) each rank reads only its shard; the
        shards are all-gathered where parameters are whole at rest."""
        if not source.partial:
            return self.buffer.initial_values(b, source)
        part = self._of[b.index]
        full32 = self.buffer.initial_values(b, source, only=part.group.inner(b))
        if part.placement.whole_at_rest:
            wait(part.group.axis.start_all_gather(full32, part.group.axis.chunk(full32)))
        return full32

    # -- ownership ---------------------------------------------------------------------------
    def owned(self, b: Bucket) -> Range:
        """The part of `b` whose optimizer update this rank runs (none of a frozen bucket)."""
        if not self.buffer.trainable(b):
            return Range(b.world.start, b.world.start)
        return self._of[b.index].owner.owned(b)

    def trainable_buckets(self) -> list[Bucket]:
        return [b for b in self.buffer.buckets if self.buffer.trainable(b)]

    # -- storage -------------------------------------------------------------------------
    def _build_bucket(self, b: Bucket, full32: torch.Tensor) -> None:
        part = self._of[b.index]
        if not self.buffer.trainable(b):
            part.placement.hold(b, "frozen_params")
            empty = torch.zeros(0, device=self.buffer.device)
            self.grads.append(empty.to(self.precision.grad))
            self.main_params.append(empty)
            self.main_grads.append(empty)
            part.group.grads[b.index] = self.grads[-1]
            return
        part.placement.hold(b, "compute_params")
        own = self.owned(b)
        if self.precision.main_is_param:
            self.main_params.append(part.placement.view(b, own))
        else:
            main = full32[b.local(own)].clone()
            self.ledger.hold("main_params", nbytes(main))
            self.main_params.append(main)
        grad, main_grad = part.grad_sync.allocate(b, own)
        part.group.grads[b.index] = grad
        self.grads.append(grad)
        self.main_grads.append(main_grad)

    def _decay_runs(self, decaying: set[int]) -> list[Range]:
        """Local ranges of the owned shard that belong to parameters taking weight decay."""
        runs, local_offset = [], 0
        for b in self.buffer.buckets:
            own = self.owned(b)
            for i in b.params:
                cut = self.buffer.layout.params[i].world.intersect(own)
                if cut is not None and i in decaying:
                    runs.append(cut.shift(local_offset - own.start))
            local_offset += own.size
        return merge_runs(runs)

    # -- phases --------------------------------------------------------------------------
    def begin_step(self) -> None:
        for part in self.groups:
            if not part.owner.in_forward:
                part.owner.finish()
        for g in self.grads:
            g.zero_()

    def backward(self, loss, last_microbatch: bool, grad: list[torch.Tensor] | None = None) -> None:
        """Backward from `loss`, scaled by the loss scale; or, with `grad`, from a pipeline stage's outputs (a list)
        and the gradients the next stage sent (scaled there already), as the sum of outputs x gradients, whose
        gradient is exactly `grad` (handed `grad`, torch checks its size through torch.fx's symbolic shapes:
        sympy's import, 0.55 s at a new process's first backward)."""
        outs, grads = self.scaled(loss, grad)
        outs = outs if grads is None else [(o * g).sum() for o, g in zip(outs, grads)]
        self._run_backward(lambda: torch.autograd.backward(outs), last_microbatch)

    def scaled(self, out, grad: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], list | None]:
        """What a backward starts from: the loss times the loss scale, or a stage's outputs and their gradients."""
        outs = out if isinstance(out, (list, tuple)) else [out]
        if grad is not None:
            return list(outs), list(grad)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return [o * scale if scale != 1.0 else o for o in outs], None

    def backward_inputs(self, run: Callable):
        """A pipeline stage's input-gradient half of a backward (`run()`; zero_bubble's I): no weight gradient
        lands, ZeRO-3 gathers as for a backward. Returns what `run` returns."""
        for part in self.groups:
            part.placement.begin_backward()
        try:
            return run()
        finally:
            for part in self.groups:
                part.placement.after_backward()

    def backward_weights(self, run: Callable, params: list, last_microbatch: bool) -> None:
        """The weight-gradient half (zero_bubble's W): `run()` writes `.grad`s without autograd's accumulation
        hooks, so each parameter's gradient is handed over once it has run."""
        def weights():
            run()
            for i, p in enumerate(self.buffer.params):
                if p.requires_grad:
                    self.buffer.landed(i, p)

        self._run_backward(weights, last_microbatch)

    def _run_backward(self, run: Callable, last_microbatch: bool) -> None:
        for part in self.groups:
            part.grad_sync.begin_backward(last_microbatch)
            part.placement.begin_backward()
        if any(part.grad_sync.per_grad() or part.placement.per_grad for part in self.groups):
            self.buffer.arm(self._on_grad)  # else each hook returns at once
        run()
        for part in self.groups:
            part.placement.after_backward()
        self.buffer.disarm()
        for part in self.groups:
            part.grad_sync.after_backward(last_microbatch)

    def _on_grad(self, i: int, param: nn.Parameter) -> None:
        b = self.buffer.buckets[self.buffer.bucket_of(i)]
        part = self._of[b.index]
        part.grad_sync.on_grad(i, b, param)
        part.placement.on_grad(i, b)

    def finish_grad_sync(self) -> None:
        for part in self.groups:
            for b in part.group.buckets:
                part.grad_sync.start(b)
            part.grad_sync.finish()
            part.owner.reduce_outer([part.grad_sync.inner_grad(b) for b in part.group.trainable])
        for finalize in self.finalizers:
            finalize(self.main_grads)

    @functools.cached_property
    def finalizers(self) -> list[Callable[[list[torch.Tensor]], None]]:
        """The gradient fix-ups this model needs after the reduction, in order."""
        out = []
        if self.tied is not None:
            out.append(TiedSum(self.tied.axis, self._tied_buckets))
        if self.tp is not None and self.tp.partial:
            out.append(TPPartialSum(self.mesh.axis("tp"), [(b, cut) for b, cut, name in self._owned_params
                                                            if name in self.tp.partial]))
        return out

    @functools.cached_property
    def _tied_buckets(self) -> list[int]:
        return [b.index for b in self.trainable_buckets()
                if all(self.buffer.names[i] in self.tied.names for i in b.params)]

    def step(self, lr: float) -> float:
        """Clip to the global gradient norm, update the owned shard, start the all-gather; skip a step whose
        gradients are not finite. Without loss scaling, the norm and the clipping stay on the device (the
        kernel skips through `found_inf`) and the host reads the norm once the step's kernels are launched."""
        self.finish_param_sync()  # the update must not race a gather still writing the buffer
        norm, clip, skip = self.grad_norm(), self.optim_cfg.grad_clip, None
        if self.scaler is not None:
            scale, norm = self.scaler.scale, float(norm) / self.scaler.scale  # the scale's update is the host's
            self.scaler.update(math.isfinite(norm))
            if not math.isfinite(norm):
                self.last_step_skipped = True
                return norm
            coef = 1.0 / scale * (min(clip / (norm + 1e-6), 1.0) if clip > 0 else 1.0)
        else:  # as torch.nn.utils.clip_grad_norm_, on the device
            coef = torch.clamp(torch.full_like(norm, clip) / (norm + 1e-6), max=1.0) if clip > 0 else 1.0
            skip = (~torch.isfinite(norm)).float()
        self.optimizer.step(self.main_grads, lr, grad_scale=coef, found_inf=skip)
        self._write_back()
        for part in self.groups:
            part.owner.start()
        if skip is not None:
            norm = float(norm)
            self.optimizer.step_count -= not math.isfinite(norm)  # the kernel skipped it
        self.last_step_skipped = not math.isfinite(norm)
        return norm

    def _write_back(self) -> None:
        """Round the updated fp32 main parameters into the compute parameters."""
        if self.precision.main_is_param:
            return
        for b, main in zip(self.buffer.buckets, self.main_params):
            if self.buffer.trainable(b):
                self._of[b.index].placement.view(b, self.owned(b)).copy_(main)

    def finish_param_sync(self, buckets: list[int] | None = None) -> None:
        """Wait until every rank holds the updated parameters of `buckets` (default: all)."""
        for part in self.groups:
            part.owner.finish(buckets)

    def after_forward_only(self) -> None:
        """After forwards without backward (evaluation): nothing is left gathered."""
        for part in self.groups:
            part.placement.after_forward_only()

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the full gradient, a float64 scalar on the device; each element counted once across
        the group: with tensor parallelism, a split parameter's shards summed over the TP ranks, a replicated
        one (the same on each) counted once. Each bucket group's squares are summed over the ranks its owned
        ranges tile (in one sum where the same), the experts' over ep too."""
        skip = set(self._tied_buckets) if self.tied is not None and not self.tied.counts else set()
        sums: dict[tuple[int, bool], tuple] = {}  # (id of the axis owned ranges tile, over ep) -> (axis, squares)
        tp = self.tp_ranks

        def add(b: int, sq: torch.Tensor, experts: bool = False) -> None:
            axis = self._of[b].owner.axis
            key = (id(axis) if axis is not None and axis.size > 1 else 0, experts)
            prev = sums.get(key, (axis, torch.zeros((), dtype=torch.float64, device=self.buffer.device)))
            sums[key] = (prev[0], prev[1] + sq)

        if self.tp is None:
            for b, g in enumerate(self.main_grads):
                if b not in skip:
                    add(b, torch.linalg.vector_norm(g.float()).double() ** 2)
        else:
            for b, cut, name in self._owned_params:
                split = self.tp.split.get(name)
                weight = 1.0 if tp == 1 or split is not None and split.axis == "tp" else 1.0 / tp
                if b not in skip:
                    add(b, weight * torch.linalg.vector_norm(self.main_grads[b][cut].float()).double() ** 2,
                        split is not None and split.axis == "ep")
        total = torch.zeros((), dtype=torch.float64, device=self.buffer.device)
        for (key, experts), (axis, sq) in sums.items():
            if key:
                dist.all_reduce(sq, group=axis.group)
            if experts:
                dist.all_reduce(sq, group=self.mesh.axis("ep").group)
            total += sq
        if tp > 1:
            dist.all_reduce(total, group=self.mesh.axis("tp").group)
        if self.pp_axis.size > 1:  # every stage's part of the model
            dist.all_reduce(total, group=self.pp_axis.group)
        return total.sqrt()

    @functools.cached_property
    def _owned_params(self) -> list[tuple[int, slice, str]]:
        """(bucket, slice of its owned shard, parameter name) for every parameter in the owned shards."""
        out = []
        for b in self.trainable_buckets():
            own = self.owned(b)
            for i in b.params:
                cut = self.buffer.layout.params[i].world.intersect(own)
                if cut is not None and cut.size:
                    out.append((b.index, cut.shift(-own.start).slice(), self.buffer.names[i]))
        return out

    # -- outside the iteration (whole weights: whole.py) -------------------------------------
    def group_record(self) -> dict[str, dict]:
        """Each bucket group: its parameters and the size of the ranks that shard and reduce it."""
        return {part.group.key.name: {"params": [self.buffer.names[i] for b in part.group.buckets for i in b.params],
                                      "shard": part.group.axis.size, "reduce": part.group.reduce.size}
                for part in self.groups}

    def memory(self) -> dict[str, int]:
        return self.ledger.report()

    # -- checkpoints -----------------------------------------------------------------------
    def pieces(self, saved: bool = False) -> list[tuple[Range, int]]:
        """This rank's part of a checkpoint, as each bucket group's public view gives it: the world ranges it owns,
        in order, each with its offset in the rank's flat shard (its main parameters and AdamW state,
        concatenated). Frozen parameters never change, so no checkpoint holds them. With `saved`, only the groups
        this rank writes: one copy of every element is written, so a group's replicas (DDP ranks, HSDP replicas)
        other than the first leave its pieces to that one; a rank loads every piece it owns."""
        out, offset = [], 0
        for b in self.buffer.buckets:
            own = self.owned(b)
            if own.size and (not saved or self._of[b.index].owner.saves_shard):
                out.append((own, offset))
            offset += own.size
        return out

    @property
    def saves_shard(self) -> bool:
        """Whether this rank writes a checkpoint shard (some group's pieces)."""
        return any(part.owner.saves_shard for part in self.groups)

    def after_load(self) -> None:
        """Main parameters were just written: round them into the compute parameters, whole where kept whole."""
        self._write_back()
        for part in self.groups:
            part.owner.start()
        self.finish_param_sync()
