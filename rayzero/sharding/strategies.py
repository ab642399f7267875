"""The base every sharding strategy shares; the strategies themselves are one class each, each
a ZeRO stage on top of the one before it (zero.py, fsdp.py):

    NoShard                 DDP: all-reduce gradients, AdamW on everything
    ShardOptim              ZeRO-1: reduce-scatter gradients, AdamW on the shard, all-gather
    ShardOptimGrads         ZeRO-2: as ZeRO-1, but each bucket is reduce-scattered on every
                            micro-batch and only the gradient shard is kept
    ShardOptimGradsParams   ZeRO-3 / FSDP (fsdp.py): as ZeRO-2, and parameters at rest are a
                            shard, gathered per unit around its forward and backward

A strategy is driven through the phases of one iteration:

    begin_step()                 gather: zero gradients; wait for the parameter all-gather
                                 (or, overlapped, let forward wait bucket by bucket)
    backward(loss, last)         backward: gradient reductions start as buckets complete
    finish_grad_sync()           reduce_scatter: finish them, then the outer (hybrid) reduction
    step(lr) -> grad_norm        step: clip by the global norm, AdamW, start the all-gather

Hybrid sharding (`dp_outer` > 1) shards within the "shard" axis and adds an outer reduction
across the "replicate" axis; with `outer_strategy=optim` the optimizer state is split across
replicas too, and parameters are all-gathered across them after the step.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from rayzero.sharding.adamw import AdamWHyper, FlatAdamW, merge_runs
from rayzero.sharding.comm import Axis, wait
from rayzero.sharding.config import OptimConfig, ShardingConfig
from rayzero.sharding.flat_buffer import Fill, FlatBuffer, ParamSource, as_source
from rayzero.sharding.layout import Bucket, Layout, Range, auto_bucket_numel, build_layout
from rayzero.sharding.memory import MemoryLedger
from rayzero.sharding.precision import Precision, build_loss_scaler
from rayzero.sharding.tensor_parallel import TPLayout, gather_global
from rayzero.sharding.mesh import Mesh


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Strategy:
    """DDP's storage (full parameters, full gradients) and the machinery every stage shares."""

    name = "base"
    reduce_every_microbatch = False  # ZeRO-2/3: gradients never stay whole across micro-batches
    _full_params_at_rest = True  # ZeRO-3: False, a rank keeps only its shard of each unit

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
    ):
        """`model` may be on the meta device when `source` gives each parameter's initial fp32
        values (a `ParamSource`, or a `fill(name, out)` function); without it the model's
        current values are copied. Parameters with `requires_grad=False` stay frozen: they
        get buckets of their own, with no gradient, main copy or optimizer state. `tp`: what
        tensor parallelism split (the model's parameters are then this rank's local shards).
        `mesh`: a connected one (its groups) on a rank; its shape alone builds on the meta device."""
        self.model = model
        self.mesh = mesh
        self.cfg = sharding
        self.optim_cfg = optim
        self.shard_axis = mesh.axis("shard")
        self.replicate_axis = mesh.axis("replicate")
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.precision = Precision.from_config(sharding)
        self.scaler = build_loss_scaler(sharding)
        self.ledger = MemoryLedger()
        self.last_step_skipped = False
        self._param_sync_in_forward = False
        self._inflight: dict[int, tuple[dist.Work | None, Callable[[], None]]] = {}
        self._reduced: set[int] = set()
        self._reduce_in_backward = False

        named, layout = self.layout(model, sharding, mesh.size("dp"))
        self.buffer = FlatBuffer(model, named, layout, self.precision.param, torch.device(device))
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
        self.ledger.hold("optimizer", 2 * _bytes(self.optimizer.exp_avg))

    def _initial_values(self, b: Bucket, source: ParamSource) -> torch.Tensor:
        """The bucket's fp32 values. From a partial source (weights in storage) each rank reads
        only its shard; the shards are all-gathered where parameters are whole at rest."""
        if not source.partial:
            return self.buffer.initial_values(b, source)
        full32 = self.buffer.initial_values(b, source, only=self.inner(b))
        if self._full_params_at_rest:
            wait(self.shard_axis.start_all_gather(full32, self.shard_axis.chunk(full32)))
        return full32

    # -- layout and ownership ------------------------------------------------------------
    @classmethod
    def layout(cls, model: nn.Module, sharding: ShardingConfig, dp_size: int) -> tuple[list, Layout]:
        """The parameters in buffer order and the buckets they fall in: what the strategy
        builds (the dry run asks it of a model on the meta device)."""
        named = cls._buffer_order(model, sharding)
        trainable = sum(p.numel() for _, p in named if p.requires_grad)
        return named, build_layout([p.numel() for _, p in named], dp_size,
                                   cls._bucket_numel(sharding, trainable, dp_size), sharding.shard_align,
                                   cls._bucket_groups(model, named, sharding))

    @classmethod
    def _buffer_order(cls, model: nn.Module, sharding: ShardingConfig) -> list[tuple[str, nn.Parameter]]:
        # Reverse order: backward produces the last layers' gradients first, so the first
        # bucket fills first and its reduction can start while backward goes on. Frozen
        # parameters go last, in buckets of their own.
        named = list(reversed(list(model.named_parameters())))
        return sorted(named, key=lambda item: not item[1].requires_grad)

    @classmethod
    def _bucket_groups(cls, model: nn.Module, named, sharding: ShardingConfig) -> list | None:
        frozen = [not p.requires_grad for _, p in named]
        return frozen if any(frozen) else None

    @classmethod
    def _bucket_numel(cls, sharding: ShardingConfig, trainable_numel: int, dp_size: int) -> int:
        if sharding.bucket_numel == "auto":
            return auto_bucket_numel(trainable_numel, dp_size)
        return sharding.bucket_numel

    def inner(self, b: Bucket) -> Range:
        """The part of `b` this rank's shard group assigns to it (world coordinates)."""
        return b.shard(self.shard_axis.rank, self.shard_axis.size)

    def owned(self, b: Bucket) -> Range:
        """The part of `b` whose optimizer update this rank runs (none of a frozen bucket)."""
        if not self.buffer.trainable(b):
            return Range(b.world.start, b.world.start)
        return self._owned_range(b)

    def _owned_range(self, b: Bucket) -> Range:
        return b.world

    @property
    def owner_axis(self) -> Axis | None:
        """The axis across which owned ranges tile the buffer exactly once (grad norm, export)."""
        return None

    def _trainable_buckets(self) -> list[Bucket]:
        return [b for b in self.buffer.buckets if self.buffer.trainable(b)]

    def _local(self, r: Range, b: Bucket) -> slice:
        return r.shift(-b.world.start).slice()

    # -- storage -------------------------------------------------------------------------
    def _build_bucket(self, b: Bucket, full32: torch.Tensor) -> None:
        if not self.buffer.trainable(b):
            self._hold_params(b, "frozen_params")
            empty = torch.zeros(0, device=self.buffer.device)
            self.grads.append(empty.to(self.precision.grad))
            self.main_params.append(empty)
            self.main_grads.append(empty)
            return
        self._hold_params(b, "compute_params")
        self._add_main(b, full32)
        self._add_grads(b)

    def _hold_params(self, b: Bucket, category: str) -> None:
        """Keep the bucket's compute parameters (whole here; ZeRO-3 keeps only its shard)."""
        self.ledger.hold(category, self.buffer.nbytes(b))

    def _add_grads(self, b: Bucket) -> None:
        grad = torch.zeros(b.world.size, dtype=self.precision.grad, device=self.buffer.device)
        self.ledger.hold("grads", _bytes(grad))
        self.grads.append(grad)
        if self.precision.grad == self.precision.param:
            for i in b.params:  # autograd accumulates straight into the bucket
                span = self.buffer.layout.params[i].world.shift(-b.world.start)
                self.buffer.params[i].grad = grad[span.slice()].view(self.buffer.params[i].shape)
        self.main_grads.append(grad[self._local(self.owned(b), b)])

    def _add_main(self, b: Bucket, full32: torch.Tensor) -> None:
        own = self.owned(b)
        if self.precision.main_is_param:
            self.main_params.append(self._param_view(b, own))
        else:
            main = full32[self._local(own, b)].clone()
            self.ledger.hold("main_params", _bytes(main))
            self.main_params.append(main)

    def _param_view(self, b: Bucket, r: Range) -> torch.Tensor:
        """The compute parameters of `b` over `r`, a view of the resident storage."""
        return self.buffer.data[b.index][self._local(r, b)]

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

    # -- gradient reduction -------------------------------------------------------------
    def _on_grad(self, i: int, param: nn.Parameter) -> None:
        b = self.buffer.buckets[self.buffer.bucket_of(i)]
        if param.grad is not None and not self._grad_is_view(i):
            span = self.buffer.layout.params[i].world
            landing = self._grad_landing(b)[self._local(span, b)]
            if param.grad.data_ptr() != landing.data_ptr():  # else autograd accumulated in place
                landing.add_(param.grad.view(-1))
            param.grad = None
        if self._reduce_in_backward and self.buffer.pending(b) == 0:
            self._start_reduce(b)

    def _grad_is_view(self, i: int) -> bool:
        return self.precision.grad == self.precision.param

    def _grad_landing(self, b: Bucket) -> torch.Tensor:
        """The full-bucket tensor a parameter's gradient is added into."""
        return self.grads[b.index]

    def _start_reduce(self, b: Bucket) -> None:
        """Launch the bucket's gradient reduction; its finisher runs after the wait."""
        if b.index in self._reduced or not self.buffer.trainable(b):
            return
        self._reduced.add(b.index)
        self._inflight[b.index] = self._launch_reduce(b)

    def _launch_reduce(self, b: Bucket) -> tuple[dist.Work | None, Callable[[], None]]:
        grad = self.grads[b.index]
        comm = self._to_comm(grad)
        work = self.shard_axis.start_all_reduce(comm)

        def finish():
            if comm is not grad:
                grad.copy_(comm)
            self._free_comm(comm, grad)

        return work, finish

    def _to_comm(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in the communication dtype: a transient copy when that differs."""
        if t.dtype == self.precision.comm or self.shard_axis.size == 1:
            return t
        c = t.to(self.precision.comm)
        self.ledger.grow(_bytes(c))
        return c

    def _free_comm(self, comm: torch.Tensor, t: torch.Tensor) -> None:
        if comm is not t:
            self.ledger.shrink(_bytes(comm))

    def _finish_reduce(self, index: int) -> None:
        work, finish = self._inflight.pop(index)
        wait(work)
        finish()

    def _finish_all_reduces(self) -> None:
        for index in sorted(self._inflight):
            self._finish_reduce(index)

    # -- phases --------------------------------------------------------------------------
    def begin_step(self) -> None:
        if not self._param_sync_in_forward:
            self.finish_param_sync()
        for g in self.grads:
            g.zero_()

    def backward(self, loss: torch.Tensor, last_microbatch: bool) -> None:
        overlap = self.cfg.overlap_grad_reduce
        self._reduce_in_backward = overlap and (last_microbatch or self.reduce_every_microbatch)
        self._reduced = set()
        self.buffer.arm(self._on_grad)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        (loss * scale if scale != 1.0 else loss).backward()
        self._after_backward(last_microbatch)

    def _after_backward(self, last_microbatch: bool) -> None:
        self.buffer.disarm()
        if self.reduce_every_microbatch:
            for b in self.buffer.buckets:  # parameters that got no gradient: reduce zeros
                self._start_reduce(b)
            if not last_microbatch:
                self._finish_all_reduces()

    def finish_grad_sync(self) -> None:
        for b in self.buffer.buckets:
            self._start_reduce(b)
        self._finish_all_reduces()
        self._reduced = set()
        self._outer_reduce()

    def _outer_reduce(self) -> None:
        """Hybrid: reduce each rank's gradient shard across the replicas."""

    def step(self, lr: float) -> float:
        """Clip to the global gradient norm, update the owned shard, start the all-gather.
        With loss scaling, a step whose gradients are not finite is skipped."""
        self.finish_param_sync()  # the update must not race a gather still writing the buffer
        self._sum_partial_grads_over_tp()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        norm = self.grad_norm() / scale
        if self.scaler is not None:
            self.scaler.update(math.isfinite(norm))
        self.last_step_skipped = not math.isfinite(norm)
        if self.last_step_skipped:
            return norm
        coef = 1.0 / scale
        clip = self.optim_cfg.grad_clip
        if clip > 0:
            coef *= min(clip / (norm + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        self.optimizer.step(self.main_grads, lr, grad_scale=coef)
        self._write_back()
        self._start_param_sync()
        return norm

    def _write_back(self) -> None:
        """Round the updated fp32 main parameters into the compute parameters."""
        if self.precision.main_is_param:
            return
        for b, main in zip(self.buffer.buckets, self.main_params):
            if self.buffer.trainable(b):
                self._param_view(b, self.owned(b)).copy_(main)

    def _start_param_sync(self) -> None:
        """After the step: begin making updated parameters whole on every rank."""

    def finish_param_sync(self, buckets: list[int] | None = None) -> None:
        """Wait until every rank holds the updated parameters of `buckets` (default: all)."""

    def after_forward_only(self) -> None:
        """After forwards without backward (evaluation): nothing is left gathered."""

    def grad_norm(self) -> float:
        """The L2 norm of the full gradient; each element counted once across the group: with
        tensor parallelism, a split parameter's shards summed over the TP ranks, a replicated
        one (the same on each) counted once."""
        sq = torch.zeros((), dtype=torch.float64, device=self.buffer.device)
        if self.tp is None:
            for g in self.main_grads:
                sq += torch.linalg.vector_norm(g.float()).double() ** 2
        else:
            for b, cut, name in self._owned_params:
                weight = 1.0 if name in self.tp.split else 1.0 / self.tp.size
                sq += weight * torch.linalg.vector_norm(self.main_grads[b][cut].float()).double() ** 2
        if self.owner_axis is not None and self.owner_axis.size > 1:
            dist.all_reduce(sq, group=self.owner_axis.group)
        if self.tp is not None:
            dist.all_reduce(sq, group=self.mesh.axis("tp").group)
        return float(sq.sqrt())

    @functools.cached_property
    def _owned_params(self) -> list[tuple[int, slice, str]]:
        """(bucket, slice of its owned shard, parameter name) for every parameter in the owned shards."""
        out = []
        for b in self._trainable_buckets():
            own = self.owned(b)
            for i in b.params:
                cut = self.buffer.layout.params[i].world.intersect(own)
                if cut is not None and cut.size:
                    out.append((b.index, cut.shift(-own.start).slice(), self.buffer.names[i]))
        return out

    def _sum_partial_grads_over_tp(self) -> None:
        """Replicated parameters whose gradient each TP rank holds a part of (key/value heads
        fewer than the TP ranks): the parts summed, on the reduced shards."""
        if self.tp is None or not self.tp.partial:
            return
        for b, cut, name in self._owned_params:
            if name in self.tp.partial:
                dist.all_reduce(self.main_grads[b][cut], group=self.mesh.axis("tp").group)

    # -- outside the iteration -------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 main parameters, whole, on CPU, by `model.state_dict()` names. Every rank
        must call it (owned pieces are summed into place across the owner axis); bucket by
        bucket, so only one bucket is ever whole on the device."""
        self.finish_param_sync()
        by_name: dict[str, torch.Tensor] = {}
        for b, main in zip(self.buffer.buckets, self.main_params):
            if self.buffer.trainable(b):
                full = torch.zeros(b.world.size, dtype=torch.float32, device=self.buffer.device)
                full[self._local(self.owned(b), b)] = main
                if self.owner_axis is not None:
                    wait(self.owner_axis.start_all_reduce(full))
            else:  # frozen: no main copy, the compute parameters are the values
                full = self._whole_params(b).float()
            for i in b.params:
                span = self.buffer.layout.params[i].world
                by_name[self.buffer.names[i]] = full[self._local(span, b)].view(
                    self.buffer.params[i].shape).cpu().clone()
        if self.tp is not None:  # the TP ranks' shards, whole (every rank of the group in one order)
            for name in sorted(n for n in by_name if n in self.tp.split):
                by_name[name] = gather_global(name, by_name[name], self.tp, self.mesh.axis("tp"))
        name_of = {id(p): n for n, p in zip(self.buffer.names, self.buffer.params)}
        out, used = {}, set()
        for key, v in self.model.state_dict(keep_vars=True).items():
            if id(v) not in name_of:  # a buffer, not a parameter: every rank holds it whole
                out[key] = v.detach().cpu().clone()
                continue
            name = name_of[id(v)]
            # A tied weight appears under each of its names, as separate tensors: file formats
            # (safetensors) refuse shared storage.
            out[key] = by_name[name].clone() if name in used else by_name[name]
            used.add(name)
        return out

    def _whole_params(self, b: Bucket) -> torch.Tensor:
        """The bucket's compute parameters, whole (every rank must call it where they are sharded)."""
        return self.buffer.data[b.index]

    def memory(self) -> dict[str, int]:
        return self.ledger.report()

    # -- checkpoints -----------------------------------------------------------------------
    def owned_pieces(self) -> list[Range]:
        """The world ranges of `main_params`, in order: this rank's part of a checkpoint
        (frozen parameters never change, so no checkpoint holds them)."""
        return [r for r in map(self.owned, self.buffer.buckets) if r.size]

    @property
    def saves_shard(self) -> bool:
        """Whether this rank writes a checkpoint shard: one copy of every element is written,
        so replicas (DDP ranks, HSDP replicas) other than the first leave it to that one."""
        axis = self.owner_axis
        if axis is None:
            return self.mesh.coord("dp") == 0
        if axis is self.shard_axis:
            return self.replicate_axis.rank == 0
        return True

    def after_load(self) -> None:
        """Main parameters were just written: round them into the compute parameters and make
        them whole where the strategy keeps them whole."""
        self._write_back()
        self._start_param_sync()
        self.finish_param_sync()
