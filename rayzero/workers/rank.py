"""One training rank as a plain class: process group, model, strategy, data slice, phases.

Runs without Ray (the dist tests drive it from plain processes); `workers/actor.py` is the
thin Ray shim around it. Every phase returns a small dict that the next phase receives, so
the controller can chain them into one compiled graph per iteration.
"""

from __future__ import annotations

import functools
import os
import time
from datetime import timedelta

from typing import Callable

import torch
import torch.distributed as dist

from rayzero.checkpoint.shards import ShardSaver, apply_shard, layout_record, read_shard
from rayzero.storage import Storage
from rayzero.config import RootConfig
from rayzero.data.kinds import batches_for
from rayzero.data.tokens import TokenDataset
from rayzero.data.validation import ValidationRows, validation_split
from rayzero.sharding.expert_parallel import ExpertParallel
from rayzero.sharding import whole
from rayzero.sharding.rng import RandomStreams
from rayzero.workers.activations import ActivationMeter
from rayzero.workers.compile import Compiling
from rayzero.objectives.registry import objective_for, remember
from rayzero.workers.assembly import assemble, context_of, identity, make_spec, whole_counts
from rayzero.workers import stages as pipeline_stages
from rayzero.workers.reference import build_reference
from rayzero.workers.disconnect import opened_while
from rayzero.workers.membership import Membership
from rayzero.workers.rendezvous import rendezvous_port
from rayzero.workers.phases import CALLS
from rayzero.workers.steps import StepContext, runner_for


def watched(fn):
    """Mark a method as the call of its name, one of `phases.CALLS`, for `Rank.progress` (what
    the controller's watchdog reads)."""
    name = fn.__name__
    assert name in CALLS, f"{name} is not in phases.CALLS"

    @functools.wraps(fn)
    def inner(self, *args, **kwargs):
        self._current = (name, time.monotonic())
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._current = None

    return inner


class Rank(Membership):
    """One rank's life: `setup` (join the group, build) → phases … → `close`. A rank whose peer
    died `leave`s its broken group and can `setup` again at a new rendezvous; a warm spare is
    made with no rank (`rank=None`), `warm`s up, and is `assign`ed the lost rank's place."""

    def __init__(self, cfg: RootConfig, rank: int | None, world_size: int, data_path: str,
                 factory: Callable | None = None, objective: type | None = None):
        """`factory`: the model's callable when given from Python (`model.kind=module`);
        `objective`: the class `train.objective` names, when given from Python or sent by the
        driver (a user's own, from their files); `rank`: None for a spare, which has no mesh
        coordinates until `assign`."""
        self.cfg = cfg
        self.factory = factory
        if objective is not None:
            remember(cfg.train.objective, objective)
        # connected to its process groups in `setup`
        self.mesh = cfg.mesh(world_size, rank) if rank is not None else None
        self.data_path = data_path
        self.device = torch.device("cpu")
        self.compiling = Compiling() if cfg.train.compile else None  # which iterations compile, for how long
        self._finished: int | None = None  # the last step whose iteration this rank finished (`progress`)
        self._times: dict[str, float] = {}
        self.saver: ShardSaver | None = None
        self.model = self.strategy = self.data = self.val = None  # built by `setup`
        self.objective = None  # the run's objective (`Objective`); its part on this rank is the runner's
        self.experts: ExpertParallel | None = None  # with parallel.ep: the MoE layers' dispatch
        self.spec = self._pipe = self.streams = self.vocab = self.meter = self.steps = None  # and these
        self.micro_per_step = 0
        self._counts = self._aux_counts = False  # whether this rank's losses count (`_counting`, at setup)
        self._batch_index = 0  # this rank's place in the `batch` role: where its rows sit among a step's
        self._staged: tuple | None = None  # a checkpoint read by `load_checkpoint`, installed by `apply_checkpoint`
        self._baseline: tuple | None = None  # the validation loss before the first step, when asked for
        self._group_sockets: set[int] = set()  # the process groups' sockets (what `disconnect` cuts)
        self.plan: dict = {}
        self._current: tuple[str, float] | None = None  # (phase, monotonic start) while in one

    def progress(self) -> dict:
        """What this rank is doing: the step, the phase it is in (None between calls) and for
        how long (while it waits on its checkpoint upload: since the upload last moved a
        block). Safe to call from another thread while a phase runs."""
        current, now = self._current, time.monotonic()
        elapsed = now - current[1] if current else 0.0
        saver = self.saver
        if current and saver is not None and saver.waiting:
            # Waiting on its checkpoint upload: slow is not stuck while bytes still move.
            elapsed = min(elapsed, now - saver.moved_at)
        return {"rank": self.mesh.rank if self.mesh is not None else None, "step": self.plan.get("step"),
                "phase": current[0] if current else None, "elapsed_s": elapsed,
                "compiling": self.compiling is not None and self.compiling.now, "finished": self._finished}

    # -- setup -------------------------------------------------------------------------
    @staticmethod
    def address(ip: str = "127.0.0.1") -> tuple[str, int]:
        """`ip` and a free port on it, for rank 0 to host the rendezvous."""
        return ip, rendezvous_port(ip)

    def _drop(self, upload_wait_s: float) -> list[dict]:
        """Release what `setup` built, the upload first (it reads the strategy's buffers).
        Returns the finished uploads not yet reported (none if the upload failed)."""
        saver, uploads = self.saver, []
        if saver is not None:
            if not saver.settle(upload_wait_s):
                raise RuntimeError(f"a checkpoint upload is still running after {upload_wait_s:g} s; "
                                   f"this rank cannot rejoin safely")
            try:
                uploads = saver.reports()
            except RuntimeError:  # a failed upload never commits; nothing to pass on
                uploads = []
        self.saver = None
        self._pipe = None  # this rank's pipeline stages and schedule, with parallel.pp > 1
        self.objective = None  # (its part on this rank, with its reference model or table, goes with the runner)
        if self.data is not None:
            self.data.close()
        self.model = self.strategy = self.data = self.val = None
        self.streams = self.vocab = self.meter = self.experts = None  # the experts' dispatch holds the ep group
        self.steps = self._staged = None
        self.plan, self._current, self._finished = {}, None, None
        return uploads

    @watched
    def setup(self, master_addr: str, master_port: int, resuming: bool = False) -> dict:
        """Join the process group at `master_addr:master_port`, build the model and strategy,
        open the data. A rank set up before leaves its old group first (`leave`). `resuming`: a
        checkpoint of this run is loaded next, so the trainable parameters are left at zero
        rather than given values that load would overwrite (frozen ones, which no checkpoint
        holds, are read as always)."""
        if self.mesh is None:
            raise RuntimeError("a spare has no rank: assign it one before setup")
        if self.model is not None or dist.is_initialized():
            self.leave()
        cfg = self.cfg
        self.compiling = Compiling() if cfg.train.compile else None  # set up again, it compiles again (`forget_compiled`)
        backend = self._join(master_addr, master_port)
        self.spec = make_spec(cfg, self.factory)
        # Dropout's streams, seeded afresh at each micro-batch's forward (`sharding/rng.py`):
        # nothing drawn in setup, evaluation or a restart shifts what training draws.
        self.streams = RandomStreams(cfg.train.seed, self.mesh.coord("tp"), self.device,
                                     self.mesh.coord("cp") if self.mesh.size("cp") > 1 else None)
        # Built on the meta device, in assembly's fixed order: the strategy materializes its
        # buckets (ZeRO-3: one unit at a time, keeping only the shard), so no rank ever holds
        # more than it must.
        # Expert parallelism: the MoE layers' token dispatch, whose loads each step reports.
        self.experts = None if self.mesh.size("ep") == 1 else ExpertParallel.from_config(self.mesh.axis("ep"), cfg)
        self.model, self.strategy, source, stages = assemble(cfg, self.spec, self.mesh, self.device, self.streams,
                                                             experts=self.experts, resuming=resuming)
        tp = self.strategy.tp
        self.vocab = tp.vocab if tp is not None else None  # the head split over the vocabulary: the loss on shards
        self._open_data()
        self._baseline = None
        self.meter = ActivationMeter(self.strategy.buffer.storage_ptrs)
        self.micro_per_step = cfg.train.global_batch_size // cfg.train.micro_batch_size
        self._pipe = None if stages is None else pipeline_stages.start_pipeline(
            cfg, self.spec, self.model, self.strategy, stages, self.mesh, self.device, self.streams, self.meter,
            self.vocab)
        if self._pipe is not None:  # the watchdog's clock restarts at each of the schedule's actions
            self._pipe.progress = lambda: setattr(self, "_current", ("pipeline", time.monotonic()))
        # The objective, and the reference model it compares with (built here: sharded the same way).
        self.objective = objective_for(cfg)
        reference = build_reference(self.objective.reference, cfg, self.spec, self.model, self.strategy, self.mesh,
                                    self.device, self.streams, self.vocab)
        ctx = StepContext(
            model=self.model, spec=self.spec, strategy=self.strategy, mesh=self.mesh, device=self.device,
            streams=self.streams, meter=self.meter, vocab=self.vocab, pipe=self._pipe, cp=context_of(cfg, self.mesh),
            data=self.data, val=self.val, reference=reference, micro_per_step=self.micro_per_step,
            tokens_per_step=self.data.tokens_per_step, masks_labels=self.data.masks_labels)
        # the step's micro-batches, plain or through the stages, with the objective's part on this rank
        self.steps = runner_for(ctx, self.objective.rank_side(ctx))
        self._counts, self._aux_counts = self._counting()
        self._batch_index = self.mesh.coord("batch")
        return {**self._setup_report(backend, source, stages), "initial_values": not resuming}

    def _join(self, master_addr: str, master_port: int) -> str:
        """Join the process group (its sockets recorded for `disconnect`) and connect the mesh's
        roles; the backend."""
        cfg = self.cfg
        backend = cfg.cluster.backend
        if backend == "auto":
            backend = "nccl" if cfg.cluster.use_gpu else "gloo"
        if cfg.cluster.use_gpu:
            self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self._group_sockets = set()
        with opened_while(self._group_sockets):  # what `disconnect` cuts (see workers/disconnect.py)
            dist.init_process_group(
                backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.mesh.rank,
                world_size=self.mesh.world_size,
                timeout=timedelta(seconds=cfg.cluster.pg_timeout_s),
            )
            self.mesh = self.mesh.connect()
        return backend

    def _open_data(self) -> None:
        """This rank's training batches and validation rows: its part of the `batch` role's split."""
        cfg = self.cfg
        dataset, val = validation_split(cfg, TokenDataset(self.data_path, storage_cfg=cfg.checkpoint))
        self.val = None if val is None else ValidationRows(
            val, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch_size,
            micro_batch=cfg.train.micro_batch_size, dp_rank=self.mesh.coord("batch"), dp_size=self.mesh.size("batch"),
            max_batches=cfg.train.eval_batches, document_masking=cfg.data.document_masking)
        self.data = batches_for(dataset, cfg.data.document_masking)(
            dataset,
            seed=cfg.train.seed,
            global_batch=cfg.train.global_batch_size,
            micro_batch=cfg.train.micro_batch_size,
            seq_len=cfg.train.seq_len,
            dp_rank=self.mesh.coord("batch"),
            dp_size=self.mesh.size("batch"),
        )
        if hasattr(self.data, "whole_steps"):  # a step of fewer rollouts: fewer micro-batches, unless staged
            self.data.whole_steps = self.mesh.size("pp") > 1

    def _setup_report(self, backend: str, source, stages) -> dict:
        """What `setup` tells the driver: the device, the model's counts and identity, the layout,
        the memory, the stages."""
        tp = self.strategy.tp
        num_params, trainable = self.spec.num_params(self.model)  # this rank's: its TP share
        whole = tp.split_numel() if tp is not None else 0  # what the other TP ranks add
        return {
            "rank": self.mesh.rank,
            "pid": os.getpid(),
            "backend": backend,
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            # the whole model's (6 per parameter a TP rank does not hold, too): tokens count once per TP group
            "flops_per_token": self.spec.flops_per_token(self.model, self.cfg.train.seq_len) + 6.0 * whole,
            **dict(zip(("num_params", "trainable_params"), whole_counts(self.model, tp))),  # the whole model's
            "params_per_rank": num_params,
            "tp": tp.record() if tp is not None else None,
            "source_bytes_read": getattr(source, "bytes_read", None),
            "buffer_numel": self.strategy.buffer.layout.numel,
            "shard_numel": sum(p.numel() for p in self.strategy.main_params),
            "memory": self._memory(),
            "saves_shard": self.strategy.saves_shard,
            "layout": layout_record(self.strategy),
            "bucket_groups": self.strategy.group_record(),
            **identity(self.model, tp, self.spec),  # what checkpoints record: params whole, at any TP size
            "pp_rank": self.mesh.coord("pp"),
            "pp": self.mesh.size("pp"),
            **(pipeline_stages.stage_report(self.spec, self.model, stages, self.cfg.train.seq_len) if stages else {}),
        }

    def _memory(self) -> dict[str, int]:
        """The ledger, and the peak bytes a micro-batch's forward has left saved for backward."""
        return {**self.strategy.memory(), **self.steps.memory()}

    # -- phases --------------------------------------------------------------------------
    @watched
    def gather(self, plan: dict) -> dict:
        """Start of an iteration: zero gradients, load this rank's batch, and wait for the
        parameter all-gather (unless the strategy waits for it inside forward)."""
        t0 = time.perf_counter()
        self.plan = plan
        if self.compiling is not None:
            self.compiling.begin(plan)
        # Before the first step, when asked: the validation loss of the initial weights.
        self._baseline = self._validation_loss() if plan.get("evaluate_first") and self.val is not None else None
        self.strategy.begin_step()
        t_data = time.perf_counter()
        if "rollout" in plan:  # online RL: the step's rows come with its plan
            self.data.take(plan["rollout"])
        rows = list(self.data.microbatches(plan["step"]))
        micro = [b.to(self.device, non_blocking=True) for b in rows]
        t_data = time.perf_counter() - t_data
        # where this rank's micro-batches sit among the step's (the same rows at any world size)
        self.steps.begin(micro, rows, plan["step"], first_micro=self._batch_index * len(micro))
        # "data": the part of gather spent on this step's rows (read a step ahead, in a thread)
        self._times = {"gather": time.perf_counter() - t0, "data": t_data, "forward": 0.0, "backward": 0.0}
        return {}

    @watched
    def forward(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        self.steps.forward()
        self._times["forward"] += time.perf_counter() - t0
        return {}

    @watched
    def pipeline(self, _prev: dict) -> dict:
        """Every micro-batch's forward and backward through this rank's stages, in the order its
        schedule gives (`pipeline/runner.py`), in place of the forward and backward phases."""
        self.steps.run(self._times)
        return {}

    @watched
    def backward(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        self.steps.backward()
        self._times["backward"] += time.perf_counter() - t0
        return {}

    @watched
    def reduce_grads(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        self.steps.check_done()
        self.strategy.finish_grad_sync()
        self._times["reduce_grads"] = time.perf_counter() - t0
        return {}

    @watched
    def step(self, _prev: dict) -> dict:
        t0 = time.perf_counter()
        grad_norm = self.strategy.step(self.plan["lr"])
        self._times["step"] = time.perf_counter() - t0
        totals = self.steps.end()
        totals.z_sum = self.spec.take_router_z()
        self._times["checkpoint"] = self._checkpoint(self.plan.get("checkpoint"))
        return {
            "rank": self.mesh.rank,
            "step": self.plan["step"],
            "lr": self.plan["lr"],
            # The ranks of a tensor-parallel group computed one loss on one micro-batch: it counts once.
            **totals.report(self._counts, with_aux=bool(self.spec.aux_coef), aux_counts=self._aux_counts),
            "grad_norm": grad_norm,
            "skipped": self.strategy.last_step_skipped,
            "loss_scale": self.strategy.scaler.scale if self.strategy.scaler is not None else None,
            "memory": self._memory(),
            "phase_s": dict(self._times),
            "uploads": self.saver.reports() if self.saver is not None else [],
            "checkpointed": bool(self.plan.get("checkpoint")),
            **({"experts": self.experts.take_loads()} if self.experts is not None else {}),
        }

    @watched
    def evaluate(self, result: dict) -> dict:
        """After the step, when the plan asks for it: the validation loss, forward only (ZeRO-3
        gathers each unit as in training, and frees it after), summed over the valid targets
        of this rank's validation rows; the controller divides by their global count."""
        t0 = time.perf_counter()
        if self.plan.get("evaluate") and self.val is not None:
            loss_sum, count, metrics = self._validation_loss()
            result = {**result, "val_loss_sum": loss_sum, "val_tokens": count, "val_objective": metrics}
        if self._baseline is not None:
            loss_sum, count, metrics = self._baseline
            result = {**result, "val0_loss_sum": loss_sum, "val0_tokens": count, "val0_objective": metrics}
        # done_at: when this rank finished the iteration, on its wall clock (the driver sleeps
        # until the next one should be done, counting from here)
        phase_s = {**result["phase_s"], "evaluate": time.perf_counter() - t0}
        if self.compiling is not None:  # what `train.compile` spent, in its phases
            phase_s["torch_compile"] = self.compiling.end(self.plan)
        self._finished = self.plan["step"]
        return {**result, "phase_s": phase_s, "done_at": time.time()}

    def _validation_loss(self) -> tuple[float, int, dict]:
        """(summed loss, its count, the objective's metrics' sums) over this rank's validation
        rows, forward only."""
        self.strategy.finish_param_sync()  # an all-gather started by the step may still be writing
        self.model.eval()
        try:
            with torch.no_grad():
                done = self.steps.validate(self.val)
        finally:
            self.model.train()
            self.strategy.after_forward_only()
        if not self._counts:  # counted once per tensor-parallel group
            return 0.0, 0, {"sum": {}, "max": {}}
        return float(done.loss_sum), done.count, done.metrics

    def _counting(self) -> tuple[bool, bool]:
        """Whether this rank's losses count: the first of its tensor-parallel group (in the last
        pipeline stage, where the loss is); for a loss over whole rows (a pair loss), which every
        rank of a cp group computes whole, the first of its cp group too. And whether its router losses count: a
        mixture's load-balancing loss is the cp group's whole (its counts summed over the group),
        so only the first of the cp group reports it."""
        counts = (self.mesh.coord("tp") == 0 and (self._pipe is None or self._pipe.stages.last)
                  and (not self.objective.whole_rows or self.mesh.coord("cp") == 0))
        return counts, counts and self.mesh.coord("cp") == 0

    def iteration(self, plan: dict) -> dict:
        """Every phase of one iteration, in order, in this process: what the controller's
        graph runs on each rank, for use without Ray."""
        out = self.gather(plan)
        if "pipeline" in self.steps.phases:
            out = self.pipeline(out)
        else:
            for _ in self.steps.micro:
                out = self.backward(self.forward(out))
        return self.evaluate(self.step(self.reduce_grads(out)))

    # -- checkpoints ------------------------------------------------------------------
    def _checkpoint(self, where: dict | None) -> float:
        """At a checkpoint step: snapshot this rank's shard and start its upload. Returns the
        seconds training was held."""
        if not where or not self.strategy.saves_shard:
            return 0.0
        if self.saver is None:
            self.saver = ShardSaver(self.strategy, asynchronous=self.cfg.checkpoint.async_)
        storage = Storage(where["uri"], self.cfg.checkpoint)
        return self.saver.save(storage, where["step"])

    @watched
    def finish_checkpoints(self) -> list[dict]:
        """Wait for the last upload; the reports not yet returned."""
        if self.saver is None:
            return []
        self.saver.wait()
        return self.saver.reports()

    @watched
    def load_checkpoint(self, uri: str, manifest: dict) -> dict:
        """Read (and reshard, and verify) this rank's part of a checkpoint; nothing is applied
        until `apply_checkpoint`, so a damaged shard on any rank leaves every rank as it was."""
        t0 = time.perf_counter()
        self._staged = (read_shard(self.strategy, Storage(uri, self.cfg.checkpoint), manifest), manifest)
        return {"rank": self.mesh.rank, "read_s": time.perf_counter() - t0}

    @watched
    def apply_checkpoint(self) -> dict:
        """Install the staged checkpoint (a collective: every rank). No random state: dropout's
        streams are seeded by step and micro-batch (`sharding/rng.py`), so a resumed run, at any
        world size, draws what the unbroken run drew."""
        t0 = time.perf_counter()
        targets, manifest = self._staged
        self._staged = None
        apply_shard(self.strategy, targets, manifest["optimizer"]["step_count"])
        if self.strategy.scaler is not None and manifest.get("loss_scale") is not None:
            self.strategy.scaler.scale = manifest["loss_scale"]
        return {"rank": self.mesh.rank, "apply_s": time.perf_counter() - t0}

    # -- outside the iteration graph -------------------------------------------------
    @watched
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's fp32 weights on CPU, by `state_dict()` names (tied weights under
        each name), on rank 0; None elsewhere. Every rank must call it: it is a collective."""
        state = whole.full_state_dict(self.strategy)
        if self._pipe is not None:  # each stage's first rank holds its stage's: gathered to rank 0
            return pipeline_stages.whole_state_dict(state if self.mesh.coord("stage") == 0 else None, self.mesh)
        return state if self.mesh.rank == 0 else None

    def weight_buckets(self, trainable_only: bool = False):
        """The whole model's weights, one bucket at a time ({name: fp32 tensor on CPU}), for the
        rollout actors: yielded on the first rank of each pipeline stage (rank 0 without stages),
        None on the others. A collective: every rank goes through it to the end."""
        sends = self.mesh.coord("stage") == 0
        for part in whole.whole_buckets(self.strategy, trainable_only):
            yield part if sends else None

    def close(self) -> None:
        """End the run on this rank: its upload finished, then, with every rank at the barrier,
        `leave`'s release (everything `setup` built, then the group), so that a kept process's
        next run and a GPU's allocator get the memory back at once."""
        if self.saver is not None:
            self.saver.wait()
        if dist.is_initialized():
            dist.barrier()
        self.leave(upload_wait_s=0.0)  # the upload is done: nothing to wait for
