"""The driver's loop: place the ranks, rendezvous, build, then drive every iteration phase by phase.

The controller is the only process that talks to MLflow and writes the run's outputs; ranks
return plain dicts. States: PLACE → RENDEZVOUS → BUILD → TRAIN → CHECKPOINT → DONE. A failure in
any of them tears the group down; the failure policy decides whether to go round again (from
PLACE, resuming from the newest commit), with how many ranks, or to give up.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from pathlib import Path

import ray
from tqdm.auto import tqdm  # a widget in Jupyter, a text bar in terminals

from rayzero.checkpoint.export import MODEL_KEY, export_identity, save_final
from rayzero.checkpoint.manifest import CheckpointError
from rayzero.checkpoint.shard_file import ChecksumError
from rayzero.storage import StorageError
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.dispatch import DISPATCHERS
from rayzero.cluster.failure import (
    ERROR, PLACEMENT, Decision, Failure, FailurePolicy, Stopped, TrainingFailed, diagnose, unwrap,
)
from rayzero.cluster.early_stopping import EarlyStopping
from rayzero.cluster.schedule import evaluates, lr_at, schedule_length
from rayzero.cluster.startup import Startup
from rayzero.cluster.throughput import throughput
from rayzero.cluster.watchdog import Watchdog
from rayzero.cluster.history import PHASES, History, load_rows, memory_metrics
from rayzero.cluster.report import run_summary, step_metrics
from rayzero.cluster.worker_group import PlacementError, WorkerGroup, free_bundles
from rayzero.config import RootConfig
from rayzero.data.tokens import dataset_tokenizer_files
from rayzero.workers.actor import RankActor
from rayzero.workers.assembly import make_spec
from rayzero.workers.results import merge, per_rank_ledgers

log = logging.getLogger(__name__)


STATE_WORDS = {"INIT": "starting", "PLACE": "placing the ranks", "RENDEZVOUS": "the rendezvous",
               "BUILD": "resuming from the checkpoint", "TRAIN": "training",
               "CHECKPOINT": "finishing the checkpoint uploads", "SAVE": "writing the final weights",
               "DONE": "finishing"}


def build_words(cfg: RootConfig, spec) -> str:
    """The start-up's line for the ranks' build: where their first weights come from."""
    m = cfg.model
    pretrained = spec.weights is not None if spec is not None else bool(m.path) and m.init != "random"
    start = f"pretrained weights from {m.path}" if pretrained else f"initial values, seed {cfg.train.seed}"
    if m.adapter:
        start += f", adapters from {m.adapter}"
    return f"building and sharding the model on the ranks ({start})"


class Controller:
    def __init__(self, cfg: RootConfig, data_path: str, run_dir: str, tracker, progress: bool = True,
                 actor_cls=RankActor, checkpoints: Checkpoints | None = None, factory=None, spec=None,
                 startup: Startup | None = None):
        """`factory`: the model's callable when given from Python; `spec`: the model seam, for
        writing the final weights (built from `cfg` when not given); `startup`: the run's
        start-up lines, begun by the caller (None: from placement on)."""
        self.cfg = cfg
        self.startup = startup or Startup()
        self.factory = factory
        self.spec = spec
        self.actor_cls = actor_cls
        self.data_path = data_path
        self.run_dir = run_dir
        self.tracker = tracker
        self.progress = progress
        self.state = "INIT"
        self.history = History()
        self.checkpoints = checkpoints  # None: checkpoints off
        if checkpoints is not None:
            checkpoints.run = {"data_path": data_path, "dir": run_dir, "mlflow_tracking_uri": tracker.uri}
        self.start_step = 0
        self.resumed_from: str | None = None
        self.policy = FailurePolicy(cfg)
        self.world = cfg.cluster.num_workers  # the current world size (elastic: may shrink)
        self.failures: list[Failure] = []
        self.resizes: list[dict] = []
        self.group: WorkerGroup | None = None
        self.dispatch = None
        self.watchdog: Watchdog | None = None
        self._recovering: Failure | None = None  # the failure whose recovery is being timed
        self._mark_t = 0.0
        self._grow_to: int | None = None
        self.start_step_next = 0  # where a group stopped to grow resumes
        self._step = None  # the iteration being collected
        self._interrupted = False  # a SIGINT arrived (see _catch_interrupts)
        self._trained = False  # this attempt has trained every step: the run is only finishing
        self._streak, self._commits_then = 0, 0  # failures since the last commit, for the backoff
        self.first_start: tuple[int, str | None] | None = None  # (step, checkpoint) the run began at
        self.schedule_steps = cfg.train.steps  # the learning-rate schedule's length (see schedule_length)
        t = cfg.train
        self.early = EarlyStopping(t.early_stopping_patience, t.early_stopping_min_delta)
        self.validates = bool(cfg.data.val_path or cfg.data.val_fraction)
        self.eval_at_start = self.validates if t.eval_at_start is None else (t.eval_at_start and self.validates)
        # Every step's row, also on disk: a resumed run's history starts at step 0, not where it resumed.
        self.history_file = Path(run_dir) / "history.jsonl"
        self.history.rows = load_rows(self.history_file)

    def fit(self) -> dict:
        """Train to `train.steps`, surviving failures: each attempt places a group, rendezvous,
        resumes from the newest commit and trains; a failure tears the whole group down and the
        policy decides whether to restart, shrink, or give up. Ctrl-C: see _catch_interrupts."""
        previous_handler = self._catch_interrupts()
        try:
            summary = self._fit()
        except Stopped:
            raise
        except KeyboardInterrupt:  # a second Ctrl-C while the run was ending (the release, MLflow's flush)
            raise self._stopped() from None
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
        if self._interrupted:
            log.warning("interrupted after the last step: the run finished and saved everything")
        return summary

    def _fit(self) -> dict:
        status = "FAILED"
        try:
            while True:
                try:
                    done, info = self._attempt()
                except Exception as exc:
                    self.world = self._recover(exc)  # or raise: the policy gave up
                    continue
                if done:
                    break
                self._release(kill=False)  # a planned resize: the commit is in, close politely
                self.resizes.append({"step": self.start_step_next, "from": self.world, "to": self._grow_to})
                log.info("growing from %d to %d ranks at step %d", self.world, self._grow_to, self.start_step_next)
                self.world, self._grow_to = self._grow_to, None
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise self._stopped() from None
        finally:
            self._release(kill=status != "FINISHED")
            self.tracker.finish(status)
        return self.summary(info)

    def _recover(self, exc: Exception) -> int:
        """After a failed attempt: diagnose, tear the group down, ask the policy, back off.
        Returns the world size to place next; raises when the policy gives up."""
        failure = self._diagnose(exc)
        self._release(kill=True)
        self._mark("teardown")
        if failure.kind == PLACEMENT and not self.failures and not self.history.losses:
            raise exc  # the very first placement: the request itself cannot be met
        commits = self.checkpoints.commits if self.checkpoints is not None else 0
        self._streak = 1 if commits > self._commits_then else self._streak + 1  # failures since a commit
        self._commits_then = commits
        capacity = free_bundles(self._bundle())
        decision = self.policy.decide(failure, len(self.failures), self._streak, self.world, capacity)
        self._record(failure, decision)
        if decision.action == "give_up":
            cause = unwrap(exc)
            if failure.kind == ERROR and isinstance(cause, CheckpointError):
                raise cause from None  # a user's mistake, already worded as one
            raise TrainingFailed(self._give_up_message(failure, decision)) from exc
        time.sleep(decision.delay_s)
        self._mark("backoff")
        return decision.world_size

    def _catch_interrupts(self):
        """Ctrl-C (or a notebook's stop button) stops the run after the iteration in flight;
        after the last step, it lets the run finish as it would have (the final commit, weights,
        MLflow, the summary), since nothing is left to stop.

        A SIGINT that arrives while the main thread waits inside Ray's compiled-graph read can
        be swallowed there; so the handler only takes note, and the loop raises
        KeyboardInterrupt at its next check. A second Ctrl-C raises at once. Returns the
        handler to restore (None off the main thread, where signals cannot be handled)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        self._interrupted = False

        def on_sigint(signum, frame):
            if self._interrupted:
                raise KeyboardInterrupt
            self._interrupted = True
            if self._trained:
                log.warning("interrupted after the last step: finishing the run (Ctrl-C again to stop now)")
            else:
                log.warning("interrupted: stopping after the current iteration (Ctrl-C again to stop now)")

        return signal.signal(signal.SIGINT, on_sigint)

    def _check_interrupt(self) -> None:
        if self._interrupted:
            raise KeyboardInterrupt

    def _stopped(self) -> Stopped:
        return Stopped(self._step, self._last_checkpoint(), finishing=self._trained)

    def _attempt(self) -> tuple[bool, dict]:
        """One group's life: PLACE → RENDEZVOUS → BUILD (resume) → TRAIN → CHECKPOINT.
        Returns (done, rank 0's info); not done means the group stopped at a checkpoint to grow."""
        self.state = "PLACE"
        self._trained = False
        bundle = ", ".join(f"{v:g} {k}" for k, v in self._bundle().items())
        self.startup.stage("placement", f"placing {self.world} ranks ({bundle} each) and starting their processes")
        self.group, self.world = self._place(self.world)
        cfg = self.cfg
        self._mark("placement")
        self.watchdog = Watchdog(self.group.actors, cfg.failure.phase_timeout_s, on_fire=self.group.kill).start()
        self._check_interrupt()
        self.state = "RENDEZVOUS"
        self.group.wait_started()
        self.startup.stage("build", build_words(cfg, self.spec))
        infos = self.group.rendezvous()
        self.pids = {i["pid"]: i["rank"] for i in infos}
        # Per rank (a tensor-parallel rank holds its share): what bytes per parameter divide by.
        self.num_params = infos[0]["params_per_rank"]
        self.flops_per_token, self.device_name = infos[0]["flops_per_token"], infos[0]["device_name"]
        self._mark("rendezvous")
        self.state = "BUILD"
        self.start_step, self.resumed_from = 0, None
        if self.checkpoints is not None:
            self.checkpoints.configure(infos, self.tracker.run_id)
            self._resume(infos[0]["params"])
        else:
            self.early.restore(None)  # from step 0 again
        dropped = self.history.rewind(self.start_step)
        if dropped:  # steps trained again: their earlier points in MLflow go (one point per step), and
            # so does an early stop after one of them (one before would have ended training there)
            keys = sorted({k for row in dropped for k in row} - {"step"})
            self.tracker.rewind(self.start_step, keys, tags=["stopped_early"])
        if self.checkpoints is not None:
            self.checkpoints.schedule_steps = self.schedule_steps
        if self.first_start is None:
            self.first_start = (self.start_step, self.resumed_from)
        self._mark("load")
        if DISPATCHERS[cfg.cluster.dispatch].preparing:
            self.startup.stage("compile", DISPATCHERS[cfg.cluster.dispatch].preparing)
        self.dispatch = DISPATCHERS[cfg.cluster.dispatch](
            self.group.actors, cfg.grad_accum_for(cfg.mesh(self.world)), timeout_s=cfg.cluster.pg_timeout_s
        )
        self.state = "TRAIN"
        grow = self._train(cfg)
        self._trained = not grow
        self.dispatch.close()
        self.dispatch = None
        if self.checkpoints is not None:  # the last uploads, then their commit
            self.state = "CHECKPOINT"
            reports = ray.get([a.finish_checkpoints.remote() for a in self.group.actors])
            before = self.checkpoints.last_committed
            self.checkpoints.add_uploads([u for r in reports for u in r])
            if self.checkpoints.last_committed != before:
                self.tracker.set_tags({"checkpoint": self.checkpoints.last_committed})
        if grow:
            return False, infos[0]
        if cfg.train.save_final:
            self.state = "SAVE"
            weights = ray.get([a.full_state_dict.remote() for a in self.group.actors])[0]
            spec = self.spec or make_spec(cfg, self.factory)
            save_final(spec, weights, cfg.train.save_final, cfg.train.save_format,
                       {"strategy": cfg.sharding.strategy, MODEL_KEY: json.dumps(export_identity(infos[0]["model"]))},
                       tokenizer=lambda: dataset_tokenizer_files(self.data_path, cfg.checkpoint),
                       storage_cfg=cfg.checkpoint)
        self.state = "DONE"
        return True, infos[0]

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cfg.cluster.cpus_per_worker}
        if self.cfg.cluster.use_gpu:
            bundle["GPU"] = 1
        return bundle

    def _place(self, world: int) -> tuple[WorkerGroup, int]:
        """A group of `world` ranks; failing that within `cluster.placement_timeout_s`
        (elastic), the largest smaller world the cluster can hold right now."""
        c = self.cfg.cluster
        first_error = None
        for w in [w for w in self.cfg.world_sizes() if w <= world]:
            try:
                group = WorkerGroup.create(
                    self.actor_cls, w, self._bundle(), lambda rank: (self.cfg, rank, w, self.data_path, self.factory),
                    strategy=c.placement_strategy,
                    # The first try waits for resources to appear; smaller ones only take what is free.
                    placement_timeout_s=c.placement_timeout_s if first_error is None else min(c.placement_timeout_s, 2.0),
                    same_node=self.cfg.parallel.tp,
                )
            except PlacementError as e:
                first_error = first_error or e
                continue
            if w < world:
                log.warning("only %d of %d ranks can be placed; continuing with %d (cluster.min_workers=%d)",
                            w, world, w, c.min_workers)
            return group, w
        if len(self.cfg.world_sizes()) > 1:
            raise PlacementError(f"{first_error}; nor any smaller world down to cluster.min_workers={c.min_workers}")
        raise first_error

    def _resume(self, params: dict) -> None:
        """Load the newest usable commit into every rank; with `auto`, a checkpoint whose shard
        fails its checksum is skipped (with a warning) for the one before it."""
        actors = self.group.actors
        for c in self.checkpoints.resume_target(params):  # with the model's record from setup (configure)
            self.startup.stage("resume", f"resuming from checkpoint {c.uri} (step {c.step})")
            try:
                ray.get([a.load_checkpoint.remote(c.uri, c.manifest) for a in actors])
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
                if self.checkpoints.resume_mode != "auto" or not isinstance(cause, ChecksumError):
                    if isinstance(cause, (StorageError, ray.exceptions.RayActorError)):
                        raise  # the storage or a rank went away: a fault to retry, not a bad checkpoint
                    raise CheckpointError(f"cannot resume from {c.uri}: {cause}") from None
                log.warning("checkpoint %s is damaged (%s); falling back to the one before it", c.uri, cause)
                continue
            ray.get([a.apply_checkpoint.remote() for a in actors])
            self.start_step, self.resumed_from = c.step, c.uri
            self.checkpoints.adopt(c.manifest)
            self.schedule_steps = schedule_length(self.cfg.train.steps, self.cfg.optim, c.manifest)
            self.early.restore(c.manifest.get("early_stopping"))
            log.info("resumed from %s at step %d", c.uri, c.step)
            self.tracker.set_tags({"resumed_from": c.uri})
            return
        self.schedule_steps = self.cfg.train.steps
        self.early.restore(None)

    def _train(self, cfg: RootConfig) -> bool:
        """Iterations from `start_step` to `train.steps`. Returns True when it stopped early, at
        a checkpoint, to grow back to a bigger world (elastic); an early stop (no improvement)
        returns False, as the end of training does."""
        h, dispatch = self.history, self.dispatch
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        first = self.start_step
        if first >= cfg.train.steps or self.early.stopped:
            return False
        left = cfg.train.steps - first
        self.startup.stage("first_step", f"training {left} step{'s' if left != 1 else ''}"
                           + (f" from step {first}" if first else ""))
        bar = tqdm(range(first, cfg.train.steps), desc="train", unit="step", disable=not self.progress,
                   mininterval=1.0, dynamic_ncols=True, initial=first, total=cfg.train.steps)
        ckpt = self.checkpoints
        grow_at = None
        plans: dict[int, dict] = {}

        def plan(k: int) -> dict:
            nonlocal grow_at
            evaluates = self._evaluates(cfg, k)
            where = ckpt.plan(k) if ckpt is not None else None
            if where is None and ckpt is not None and evaluates and self.early.may_stop_next():
                where = ckpt.plan(k, force=True)  # this evaluation may end the run: commit what it saw
            if where and grow_at is None and k + 1 < cfg.train.steps and self._can_grow():
                grow_at = k  # resources are back: stop after this checkpoint and regroup
            plans[k] = {"step": k, "lr": lr_at(k, self.schedule_steps, cfg.optim), "checkpoint": where,
                        "evaluate": evaluates, "evaluate_first": k == 0 and self.eval_at_start,
                        # every rank's memory ledger, for the summary: where the run may end
                        "ledgers": k + 1 == cfg.train.steps or (evaluates and bool(self.early.patience))}
            return plans[k]

        last = time.perf_counter()
        pending = dispatch.submit(plan(first))
        for step in bar:
            self._step = step
            self._check_interrupt()
            more = step + 1 < cfg.train.steps and grow_at != step
            # Queue the next iteration before reading this one: ranks never wait on the driver;
            # except after an evaluation that may end the run, which must be read first.
            hold = bool(self.early.patience) and plans.pop(step)["evaluate"]
            queued = dispatch.submit(plan(step + 1)) if more and not hold else None
            results = dispatch.collect(pending, queued=queued is not None)
            self.startup.first_step()
            now = time.perf_counter()
            dt, last = now - last, now
            stop = self._record_step(cfg, step, results, dt, tokens_per_step, first)
            bar.set_postfix(loss=f"{h.losses[-1]:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
            if stop:
                bar.close()
                return False
            if grow_at == step:
                self.start_step_next = step + 1
                bar.close()
                return True
            if hold and more:
                queued = dispatch.submit(plan(step + 1))
            pending = queued
        return False

    def _record_step(self, cfg: RootConfig, step: int, results: list[dict], dt: float, tokens_per_step: int,
                     first: int) -> bool:
        """One iteration's results into the history, MLflow and the checkpoints. True when
        early stopping ends the run after it. `results`: one per rank or per node (see
        `CompiledDispatch`), merged here into one, which reads as a rank's result does."""
        h = self.history
        result = merge(results)
        results = [result]
        phase = {p: max(r["phase_s"][p] for r in results) for p in PHASES}  # the slowest rank's
        metrics = step_metrics(results, phase, dt, tokens_per_step, self.world,
                               throughput(tokens_per_step / dt, self.world, self.flops_per_token, self.device_name),
                               cfg.train.global_batch_size // cfg.train.micro_batch_size)
        h.record(step, metrics["loss"], dt, phase)
        skipped = results[0]["skipped"]
        stop = False
        if "val0_loss_sum" in results[0]:  # before the first step: the curve's baseline, at step -1
            base = self._val_loss(results, "val0_")
            self._log_val(-1, base, {})
            self.early.observe(-1, base)
        if "val_loss_sum" in results[0]:
            val = self._val_loss(results, "val_")
            self._log_val(step, val, metrics)
            stop = self.early.observe(step, val)
            if stop:
                log.warning("stopping early after step %d: %s", step, self.early.stopped)
                self.tracker.set_tags({"stopped_early": f"after step {step}: {self.early.stopped}"})
        h.skipped += int(skipped)
        h.memory = per_rank_ledgers(result) or [result["memory"]]  # the per-rank ones where the run may end
        if step == first:
            metrics["world_size"] = self.world
        if step == 0 or step + 1 == cfg.train.steps or stop:
            metrics.update(memory_metrics(h.memory, self.num_params))
        ckpt = self.checkpoints
        if ckpt is not None:
            metrics["checkpoint_stall_ms"] = max(r["phase_s"].get("checkpoint", 0.0) for r in results) * 1e3
            if ckpt.mlflow_run_id is None and any(r["uploads"] for r in results):  # a commit may come
                # The MLflow run a rerun goes on with, for its manifest: a slow store may have
                # created it only after `configure` asked (reading run_id waits 2 s at most).
                ckpt.mlflow_run_id = self.tracker.run_id
            before = ckpt.last_committed
            record = {"early_stopping": self.early.state()}
            if "val_loss" in metrics:
                record["metrics"] = {"val_loss": metrics["val_loss"]}
            ckpt.collect(step, results, record)
            if ckpt.last_committed != before:
                self.tracker.set_tags({"checkpoint": ckpt.last_committed})
        if self._recovering is not None and step == first:
            metrics["recovery_s"] = self._recovered()
        self.tracker.log_metrics(step, metrics)
        self._add_row({"step": step, "world_size": self.world, **metrics})
        return stop

    @staticmethod
    def _val_loss(results: list[dict], prefix: str) -> float:
        return sum(r[f"{prefix}loss_sum"] for r in results) / max(sum(r[f"{prefix}tokens"] for r in results), 1)

    def _log_val(self, step: int, val: float, metrics: dict) -> None:
        """A validation loss: into `metrics` (this step's row), or at `step` on its own (the
        baseline before the first step)."""
        h = self.history
        values = {"val_loss": val, "val_perplexity": math.exp(min(val, 700.0))}
        h.val_steps.append(step)
        h.val_losses.append(val)
        if metrics is not None and step >= 0:
            metrics.update(values)
            return
        self.tracker.log_metrics(step, values)
        self._add_row({"step": step, **values})

    def _add_row(self, row: dict) -> None:
        self.history.rows.append(row)
        try:  # the on-disk copy is a convenience: a full disk must not stop training
            with open(self.history_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            log.debug("could not append to %s: %s", self.history_file, e)

    def _evaluates(self, cfg: RootConfig, k: int) -> bool:
        due = self.checkpoints is not None and self.checkpoints.plan(k) is not None
        return self.validates and evaluates(cfg, k, checkpoint_due=due)

    def _can_grow(self) -> bool:
        """Below the configured world and the cluster now holds a bigger valid one."""
        if self.world >= self.cfg.cluster.num_workers:
            return False
        free = free_bundles(self._bundle(), settle_s=0.0)
        bigger = [w for w in self.cfg.world_sizes() if self.world < w <= self.world + free]
        if bigger:
            self._grow_to = bigger[0]
        return bool(bigger)

    # -- failures ---------------------------------------------------------------------
    def _diagnose(self, exc: BaseException) -> Failure:
        """Who failed, where, and how: the watchdog's finding if it fired, else `diagnose` of
        the dead ranks and the exception."""
        detected = time.time()
        wd, self.watchdog = self.watchdog, None
        if wd is not None:
            wd.stop()
        last = wd.last if wd is not None else {}
        if wd is not None and wd.fired is not None:
            failure = wd.fired
        else:
            rank = phase = None
            if isinstance(exc, ray.exceptions.RayTaskError):
                rank = self.pids.get(getattr(exc, "pid", None)) if hasattr(self, "pids") else None
                phase = (getattr(exc, "function_name", "") or "").rpartition(".")[2] or None
            failure = diagnose(exc, rank, phase, dead=self._dead_ranks(), last_seen=last,
                               step=self._step if self.state == "TRAIN" else None, doing=STATE_WORDS[self.state])
        failure.detected_at = detected
        self._recovering, self._mark_t = failure, detected
        self._mark("diagnose")
        if failure.kind != ERROR:  # an error in the training code is reported once, as the run ends
            log.warning("failure (%s): %s", failure.kind, failure.message)
        return failure

    def _dead_ranks(self, timeout_s: float = 2.0) -> list[tuple[int, BaseException]]:
        """(rank, why) for each rank actor that is dead, asking every one of them."""
        group = self.group
        if group is None or not group.actors:
            return []
        refs = [a.progress.remote() for a in group.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for r, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    dead.append((r, e))
        return dead

    def _record(self, failure: Failure, decision: Decision) -> None:
        self.failures.append(failure)
        n = len(self.failures)
        failure.decision, failure.world_size = decision.action, decision.world_size
        text = (f"step {failure.step}: {failure.message} -> {decision.action}"
                + (f" at {decision.world_size} ranks" if decision.action != "give_up" else f" ({decision.reason})"))
        if decision.action != "give_up":
            log.warning("restart %d: %s", n, text)
        try:  # MLflow must not turn a recoverable failure into a fatal one
            self.tracker.set_tags({f"failure.{n}": text[:5000], "failure.last_cause": failure.kind})
            if decision.action != "give_up":
                self.tracker.log_metrics(failure.step or self.start_step, {"restarts": float(n)})
        except Exception as e:
            log.warning("could not record the failure in MLflow: %s", e)

    def _give_up_message(self, failure: Failure, decision: Decision) -> str:
        restarts = len(self.failures) - 1
        last = self._last_checkpoint()
        where = (f"The last committed checkpoint is {last}; run the same command again to resume from it"
                 if last else "No checkpoint was committed")
        more = failure.detail.splitlines()[1:] if failure.kind == ERROR else []
        return (f"training stopped after {restarts} restart{'s' if restarts != 1 else ''} "
                f"({decision.reason}): {failure.message}"
                + "".join(f"\n  {line}" for line in more) + f"\n{where}.")

    def _last_checkpoint(self) -> str | None:
        """What a rerun resumes from: this run's last commit, else the one it resumed from."""
        if self.checkpoints is None:
            return None
        return self.checkpoints.last_committed or self.resumed_from or (self.first_start or (0, None))[1]

    def _mark(self, name: str) -> None:
        """Time one stage of the recovery under way, if any."""
        if self._recovering is None:
            return
        now = time.time()
        self._recovering.timings[f"{name}_s"] = self._recovering.timings.get(f"{name}_s", 0.0) + now - self._mark_t
        self._mark_t = now

    def _recovered(self) -> float:
        """The first step after a failure is done: close its recovery timings."""
        self._mark("first_step")
        f, self._recovering = self._recovering, None
        f.timings["total_s"] = time.time() - f.detected_at
        log.info("recovered from %s in %.1fs", f.kind, f.timings["total_s"])
        return f.timings["total_s"]

    def _release(self, kill: bool) -> None:
        """Stop the watchdog and free the group: killed at once after a failure (a graph or a
        process group waits on a lost member until it times out), closed politely otherwise."""
        wd, self.watchdog = self.watchdog, None
        if wd is not None:
            wd.stop()
        group, self.group = self.group, None
        dispatch, self.dispatch = self.dispatch, None
        if kill and group is not None:
            group.kill()
        if dispatch is not None:
            try:
                dispatch.close()
            except Exception as e:
                log.debug("closing the dispatcher failed: %s", e)
        if group is not None and not kill:
            try:
                group.shutdown()
            except Exception as e:
                log.warning("shutting the group down failed: %s", e)

    def summary(self, rank0_info: dict) -> dict:
        return {**run_summary(self, rank0_info), "startup": self.startup.timings()}
