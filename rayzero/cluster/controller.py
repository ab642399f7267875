"""The driver's loop: place the ranks, rendezvous, build, then drive every iteration phase by phase.

The controller is the only process that talks to MLflow and writes the run's outputs; ranks
return plain dicts. States: PLACE → RENDEZVOUS → BUILD → TRAIN → DONE.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from statistics import mean

import ray
from tqdm import tqdm

from rayzero.checkpoint.export import save_safetensors
from rayzero.checkpoint.manifest import CheckpointError
from rayzero.checkpoint.shard_file import ChecksumError
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.dispatch import DISPATCHERS
from rayzero.cluster.schedule import lr_at
from rayzero.cluster.worker_group import WorkerGroup
from rayzero.config import RootConfig
from rayzero.sharding.memory import bytes_per_param
from rayzero.workers.actor import RankActor

log = logging.getLogger(__name__)

PHASES = ("gather", "forward", "backward", "reduce_scatter", "step")
WARMUP_STEPS = 1  # the first iteration compiles the graph and faults in memory: not timed


@dataclass
class History:
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    phase_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    skipped: int = 0
    memory: list[dict[str, int]] = field(default_factory=list)  # each rank's ledger, latest

    def timed(self, values: list[float]) -> list[float]:
        return values[WARMUP_STEPS:] or values


class Controller:
    def __init__(self, cfg: RootConfig, data_path: str, run_dir: str, tracker, progress: bool = True,
                 actor_cls=RankActor, checkpoints: Checkpoints | None = None):
        self.cfg = cfg
        self.actor_cls = actor_cls
        self.data_path = data_path
        self.run_dir = run_dir
        self.tracker = tracker
        self.progress = progress
        self.state = "INIT"
        self.history = History()
        self.checkpoints = checkpoints  # None: checkpoints off
        self.start_step = 0
        self.resumed_from: str | None = None

    def fit(self) -> dict:
        cfg = self.cfg
        group = dispatch = None
        status = "FAILED"
        try:
            self.state = "PLACE"
            bundle = {"CPU": cfg.cluster.cpus_per_worker}
            if cfg.cluster.use_gpu:
                bundle["GPU"] = 1
            group = WorkerGroup.create(
                self.actor_cls,
                cfg.cluster.num_workers,
                bundle,
                lambda rank: (cfg, rank, cfg.cluster.num_workers, self.data_path),
                strategy=cfg.cluster.placement_strategy,
                placement_timeout_s=cfg.cluster.placement_timeout_s,
            )
            self.state = "RENDEZVOUS"
            infos = group.rendezvous()
            self.num_params = infos[0]["num_params"]
            self.state = "BUILD"
            if self.checkpoints is not None:
                self.checkpoints.configure(infos, self.tracker.run_id)
                self._resume(group, infos[0]["params"])
            dispatch = DISPATCHERS[cfg.cluster.dispatch](
                group.actors, cfg.grad_accum, timeout_s=cfg.cluster.pg_timeout_s
            )
            self.state = "TRAIN"
            self._train(dispatch)
            dispatch.close()
            dispatch = None
            if self.checkpoints is not None:  # the last uploads, then their commit
                self.state = "CHECKPOINT"
                reports = ray.get([a.finish_checkpoints.remote() for a in group.actors])
                self.checkpoints.add_uploads([u for r in reports for u in r])
            if cfg.train.save_final:
                weights = ray.get([a.full_state_dict.remote() for a in group.actors])[0]
                save_safetensors(weights, cfg.train.save_final, {"strategy": cfg.sharding.strategy})
            self.state = "DONE"
            status = "FINISHED"
            return self.summary(infos[0])
        finally:
            _teardown(dispatch, group, self.tracker, status)

    def _resume(self, group: WorkerGroup, params: dict) -> None:
        """Load the newest usable commit into every rank; with `auto`, a checkpoint whose shard
        fails its checksum is skipped (with a warning) for the one before it."""
        for c in self.checkpoints.resume_target(params):
            try:
                ray.get([a.load_checkpoint.remote(c.uri, c.manifest) for a in group.actors])
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
                if self.cfg.checkpoint.resume != "auto" or not isinstance(cause, ChecksumError):
                    raise CheckpointError(f"cannot resume from {c.uri}: {cause}") from None
                log.warning("checkpoint %s is damaged (%s); falling back to the one before it", c.uri, cause)
                continue
            ray.get([a.apply_checkpoint.remote() for a in group.actors])
            self.start_step, self.resumed_from = c.step, c.uri
            log.info("resumed from %s at step %d", c.uri, c.step)
            self.tracker.set_tags({"resumed_from": c.uri})
            return

    def _train(self, dispatch) -> None:
        cfg, h = self.cfg, self.history
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        first = self.start_step
        if first >= cfg.train.steps:
            return
        bar = tqdm(range(first, cfg.train.steps), desc="train", unit="step", disable=not self.progress,
                   mininterval=1.0, dynamic_ncols=True, initial=first, total=cfg.train.steps)
        ckpt = self.checkpoints

        def plan(k: int) -> dict:
            return {"step": k, "lr": lr_at(k, cfg.train.steps, cfg.optim),
                    "checkpoint": ckpt.plan(k) if ckpt is not None else None}

        last = time.perf_counter()
        pending = dispatch.submit(plan(first))
        for step in bar:
            # Queue the next iteration before reading this one: ranks never wait on the driver.
            queued = dispatch.submit(plan(step + 1)) if step + 1 < cfg.train.steps else None
            results = dispatch.collect(pending)
            now = time.perf_counter()
            dt, last, pending = now - last, now, queued
            lr = results[0]["lr"]
            loss = sum(r["loss_sum"] for r in results) / sum(r["tokens"] for r in results)
            phase = {p: max(r["phase_s"][p] for r in results) for p in PHASES}
            h.losses.append(loss)
            h.step_s.append(dt)
            for p in PHASES:
                h.phase_s[p].append(phase[p])
            skipped = results[0]["skipped"]
            metrics = {
                "loss": loss,
                "skipped_step": float(skipped),  # fp16 loss scaling found inf/NaN: no update
                "lr": lr,
                "grad_norm": results[0]["grad_norm"],
                "tokens_per_s": tokens_per_step / dt,
                "step_ms": dt * 1e3,
                # Wall time outside the slowest rank's phases: dispatch, transfer, waiting.
                "dispatch_overhead_ms": max(0.0, dt - sum(phase.values())) * 1e3,
                **{f"phase_{p}_ms": v * 1e3 for p, v in phase.items()},
            }
            if results[0]["loss_scale"] is not None:
                metrics["loss_scale"] = results[0]["loss_scale"]
            h.skipped += int(skipped)
            h.memory = [r["memory"] for r in results]
            if step == 0 or step + 1 == cfg.train.steps:
                metrics.update(memory_metrics(h.memory, self.num_params))
            if ckpt is not None:
                metrics["checkpoint_stall_ms"] = max(r["phase_s"].get("checkpoint", 0.0) for r in results) * 1e3
                ckpt.collect(step, results)
            self.tracker.log_metrics(step, metrics)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)

    def summary(self, rank0_info: dict) -> dict:
        cfg, h = self.cfg, self.history
        trained = bool(h.losses)
        step_s = mean(h.timed(h.step_s)) if trained else None
        memory = h.memory or [rank0_info["memory"]]
        ckpt = self.checkpoints
        return {
            "first_loss": h.losses[0] if trained else None,
            "final_loss": h.losses[-1] if trained else None,
            "steps": len(h.losses),
            "start_step": self.start_step,
            "total_steps": cfg.train.steps,
            "tokens_per_s": cfg.train.global_batch_size * cfg.train.seq_len / step_s if trained else None,
            "step_ms": step_s * 1e3 if trained else None,
            "phase_ms": {p: mean(h.timed(v)) * 1e3 for p, v in h.phase_s.items()} if trained else {},
            "world_size": cfg.cluster.num_workers,
            "strategy": cfg.sharding.strategy,
            "grad_accum": cfg.grad_accum,
            "num_params": rank0_info["num_params"],
            "backend": rank0_info["backend"],
            "dispatch": cfg.cluster.dispatch,
            "mlflow_run_id": self.tracker.run_id,
            "mlflow_tracking_uri": self.tracker.uri,
            "run_dir": self.run_dir,
            "final_weights": cfg.train.save_final or None,
            "skipped_steps": h.skipped,
            "resumed_from": self.resumed_from,
            "checkpoint": ckpt.last_committed if ckpt is not None else None,
            "checkpoints_committed": ckpt.commits if ckpt is not None else 0,
            "memory": {
                "bytes_per_param": bytes_per_param(memory, self.num_params),
                "transient_bytes": max(r["transient_peak"] for r in memory),
                "per_rank": memory,
                "param_dtype": cfg.sharding.param_dtype,
                "grad_dtype": cfg.sharding.grad_dtype,
            },
        }


def memory_metrics(reports: list[dict[str, int]], num_params: int) -> dict[str, float]:
    """The ledger as MLflow metrics: bytes per parameter per category (max over ranks) and
    the peak transient in MiB."""
    out = {f"memory_{k}_bytes_per_param": v for k, v in bytes_per_param(reports, num_params).items()}
    out["memory_transient_peak_mib"] = max(r["transient_peak"] for r in reports) / 2**20
    return out


def _teardown(dispatch, group: WorkerGroup | None, tracker, status: str) -> None:
    """Release everything, each step even if an earlier one fails (a dead rank can make the
    graph's teardown raise; the actors and placement group must go regardless)."""
    steps = [
        dispatch.close if dispatch is not None else None,
        group.shutdown if group is not None else None,
        lambda: tracker.finish(status),
    ]
    for step in filter(None, steps):
        try:
            step()
        except Exception:
            log.exception("teardown step failed; continuing")
