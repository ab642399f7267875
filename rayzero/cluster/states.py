"""The controller's states: each does one thing with the run and returns the state after it.

    Placing → Building → Resuming → Training → Finishing → Done
       ↑                                          │ resources are back: regroup at a commit
       ├─────────────────── Resizing ←────────────┘
       └─────────────────── Recovering ←── a failure in any state before Done (recovery.py)
                               │ ranks lost while training, warm spares ready for them
                               └→ Replacing → Building (the same group, the other ranks' processes kept)

`state.next(run)` takes the run (`controller.Controller`: the config, the policies, the
cluster, the tracker, the checkpoints, the history and the run record) and returns the next
state; whatever the next state needs from this one it gets as an argument. A group of ranks,
once placed, travels from state to state in a `Live` until one releases it: Resizing politely,
Recovering by killing it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field

import ray
from tqdm.auto import tqdm  # a widget in Jupyter, a text bar in terminals

from rayzero.checkpoint.export import MODEL_KEY, export_identity, save_final
from rayzero.checkpoint.manifest import CheckpointError
from rayzero.checkpoint.shard_file import ChecksumError
from rayzero.checkpoint.stages import whole_build
from rayzero.cluster.history import PHASES, memory_metrics
from rayzero.cluster.report import step_metrics
from rayzero.cluster.schedule import lr_at, schedule_length
from rayzero.cluster.throughput import throughput
from rayzero.cluster.worker_group import PlacementError
from rayzero.config import RootConfig
from rayzero.data.tokens import dataset_tokenizer_files
from rayzero.storage import StorageError
from rayzero.workers.assembly import make_spec
from rayzero.step_report import merge, per_rank_ledgers

log = logging.getLogger(__name__)


@dataclass
class Live:
    """A placed group and what runs alongside it: its watchdog, and while training, its dispatch."""

    group: object  # worker_group.WorkerGroup (or a stand-in in the tests)
    watchdog: object | None = None
    dispatch: object | None = None

    def release(self, kill: bool) -> None:
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


class State:
    code = ""  # its short name (`Controller.state`)
    doing = ""  # what the run does in it, for a failure that no rank raised
    # A state that holds a group has it as `live` (what a failure in it must release): see held().

    def next(self, run) -> "State":
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


def held(state: State) -> Live | None:
    """The group `state` holds, if any."""
    return getattr(state, "live", None)


# -- placing and building a group ---------------------------------------------------------
def bundle_words(bundle: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items())


def ranks_words(world: int) -> str:
    """`2 ranks`, `1 rank`."""
    return f"{world} rank{'s' if world != 1 else ''}"


def build_words(cfg: RootConfig, spec, resuming: bool = False) -> str:
    """The start-up's line for the ranks' build: where their first weights come from."""
    if resuming:
        return "building and sharding the model on the ranks (its trainable weights from this run's last commit)"
    m = cfg.model
    pretrained = spec.weights is not None if spec is not None else bool(m.path) and m.init != "random"
    start = f"pretrained weights from {m.path}" if pretrained else f"initial values, seed {cfg.train.seed}"
    if m.adapter:
        start += f", adapters from {m.adapter}"
    return f"building and sharding the model on the ranks ({start})"


@dataclass(repr=False)
class Placing(State):
    """Reserve room for `world` ranks and start their processes; failing that within
    `cluster.placement_timeout_s` (elastic), the largest smaller world the scaling policy allows
    that the cluster holds now."""

    world: int
    code = "PLACE"
    doing = "placing the ranks"

    def next(self, run) -> State:
        run.record.world = self.world
        c = run.cfg.cluster
        processes = "their processes" if self.world > 1 else "its process"
        node = run.cfg.mesh().size("node")  # ranks kept on one node
        ahead = run.cluster.placed_ahead(run.actor_cls, self.world, run.bundle, c.placement_strategy, node)
        if ahead is not None:
            run.startup.stage("placement", f"placing {ranks_words(self.world)} ({bundle_words(run.bundle)} each) "
                                           f"and starting {processes} (begun at {ahead:.1f}s, as Ray came up)")
        elif c.keep_ranks and run.cluster.kept(run.actor_cls, self.world, run.bundle, c.placement_strategy, node):
            run.startup.stage("placement", f"taking the {ranks_words(self.world)} the last run kept "
                                           f"({bundle_words(run.bundle)} each)")
        else:
            run.startup.stage("placement", f"placing {ranks_words(self.world)} ({bundle_words(run.bundle)} each) "
                                           f"and starting {processes}")
        group, world = self.place(run, node)
        run.record.world = world
        run.start_spares(world)
        if run.driver_side is not None:  # online RL's actors start while the ranks build and resume
            run.driver_side.start()
        run.clock.mark("placement")
        live = Live(group)
        live.watchdog = run.make_watchdog(group.actors, on_fire=group.kill)
        return Building(live)

    def place(self, run, node: int):
        """`node`: how many consecutive ranks to keep on one node (the mesh's `node` role)."""
        cfg, c = run.cfg, run.cfg.cluster
        first_error = None
        candidates = run.scaling.to_place(self.world)
        for w in candidates:
            try:
                group = run.cluster.place(
                    run.actor_cls, w, run.bundle, lambda rank, w=w: (cfg, rank, w, run.data_path, run.factory, run.objective_cls),
                    strategy=c.placement_strategy,
                    # The first try waits for resources to appear; smaller ones only take what is free.
                    placement_timeout_s=c.placement_timeout_s if first_error is None else min(c.placement_timeout_s, 2.0),
                    same_node=node, keep=c.keep_ranks,
                )
            except PlacementError as e:
                first_error = first_error or e
                continue
            if w < self.world:
                log.warning("only %d of %d ranks can be placed; continuing with %d (cluster.min_workers=%d)",
                            w, self.world, w, c.min_workers)
            return group, w
        if run.scaling.elastic:
            raise PlacementError(f"{first_error}; nor any smaller world down to cluster.min_workers={c.min_workers}")
        raise first_error


@dataclass(repr=False)
class Building(State):
    """Wait for the ranks' processes, then the rendezvous: every rank joins the process group
    and builds its share of the model."""

    live: Live
    code = "BUILD"
    doing = "building the model on the ranks"

    def next(self, run) -> State:
        run.check_interrupt()
        group = self.live.group
        group.wait_started()
        # A group rebuilt after this run has committed resumes from its own commit (Resuming):
        # the ranks give initial values only to what no checkpoint holds
        resuming = run.checkpoints is not None and run.checkpoints.commits > 0
        run.startup.stage("build", build_words(run.cfg, run.spec, resuming))
        infos = group.rendezvous(resuming=resuming)
        run.record.pids = {i["pid"]: i["rank"] for i in infos}
        run.record.build = whole_build(infos)  # with pipeline stages, the whole model's
        run.clock.mark("rendezvous")
        return Resuming(self.live, infos)


@dataclass(repr=False)
class Resuming(State):
    """Load the newest usable commit into every rank (none: from step 0), and forget what the
    history holds of the steps to be trained again."""

    live: Live
    infos: list[dict]
    code = "RESUME"
    doing = "resuming from the checkpoint"

    def next(self, run) -> State:
        rec, ckpt = run.record, run.checkpoints
        rec.start_step, rec.resumed_from = 0, None
        if ckpt is not None:
            ckpt.configure(self.infos, lambda: run.tracker.run_id)  # asked at a commit: MLflow may not have begun
            self.resume(run, whole_build(self.infos)["params"])
        else:
            run.early.restore(None)  # from step 0 again
            rec.schedule_steps = run.cfg.train.steps
        dropped = run.history.rewind(rec.start_step)
        if dropped:  # steps trained again: their earlier points in MLflow go (one point per step), and
            # so does an early stop after one of them (one before would have ended training there);
            # history.jsonl keeps one row per step too
            run.rewrite_history()
            keys = sorted({k for row in dropped for k in row} - {"step"})
            run.tracker.rewind(rec.start_step, keys, tags=["stopped_early"])
        if ckpt is not None:
            ckpt.schedule_steps = rec.schedule_steps
        if rec.first_start is None:
            rec.first_start = (rec.start_step, rec.resumed_from)
        run.clock.mark("load")
        return Training(self.live, rec.start_step)

    def resume(self, run, params: dict) -> None:
        """With `checkpoint.resume=auto`, a checkpoint whose shard fails its checksum is
        skipped (with a warning) for the one before it."""
        ckpt, rec, group = run.checkpoints, run.record, self.live.group
        for c in ckpt.resume_target(params):  # with the model's record from setup (configure)
            run.startup.stage("resume", f"resuming from checkpoint {c.uri} (step {c.step})")
            try:
                group.call("load_checkpoint", c.uri, c.manifest)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
                if ckpt.resume_mode != "auto" or not isinstance(cause, ChecksumError):
                    if isinstance(cause, (StorageError, ray.exceptions.RayActorError)):
                        raise  # the storage or a rank went away: a fault to retry, not a bad checkpoint
                    raise CheckpointError(f"cannot resume from {c.uri}: {cause}") from None
                log.warning("checkpoint %s is damaged (%s); falling back to the one before it", c.uri, cause)
                continue
            group.call("apply_checkpoint")
            rec.start_step, rec.resumed_from = c.step, c.uri
            ckpt.adopt(c.manifest)
            rec.schedule_steps = schedule_length(run.cfg.train.steps, run.cfg.optim, c.manifest)
            run.early.restore(c.manifest.get("early_stopping"))
            if run.driver_side is not None:  # online RL: the rounds in flight at the commit
                try:
                    run.driver_side.restore(c.manifest.get("rollouts"))
                except ValueError as e:  # a setting the rounds in flight cannot go on under
                    raise CheckpointError(f"cannot resume from {c.uri}: {e}") from None
            log.info("resumed from %s at step %d", c.uri, c.step)
            run.tracker.set_tags({"resumed_from": c.uri})
            return
        if not all(i.get("initial_values", True) for i in self.infos):  # set up for a commit none of which loaded
            log.warning("no commit of this run could be loaded: training again from the initial values")
            self.infos = group.rendezvous()
        rec.schedule_steps = run.cfg.train.steps
        run.early.restore(None)
        if run.driver_side is not None:
            run.driver_side.restore(None)


# -- training -------------------------------------------------------------------------------
@dataclass(repr=False)
class Training(State):
    """Iterations from `first` to `train.steps`, each planned here (learning rate, checkpoint,
    evaluation) and run by the dispatcher on every rank. Ends at the last step, at an early stop,
    or at a commit after which the scaling policy wants a bigger world (elastic: room is back)."""

    live: Live
    first: int
    code = "TRAIN"
    doing = "training"
    grow: "Grow | None" = field(default=None, init=False)

    def next(self, run) -> State:
        cfg = run.cfg
        rec = run.record
        prepare = run.dispatcher.preparing
        if prepare:
            run.startup.stage("compile", prepare)
        mesh = cfg.mesh(rec.world)
        if run.driver_side is not None:  # the ranks were (re)built: the rollout actors get every weight again
            run.driver_side.restarted()
        self.live.dispatch = run.dispatcher(self.live.group.actors, cfg.grad_accum_for(mesh),
                                            timeout_s=cfg.cluster.pg_timeout_s, staged=mesh.size("pp") > 1)
        run.clock.mark("graph")  # after a failure: the iteration's graph built again, for the new group
        self.train(run)
        dispatch, self.live.dispatch = self.live.dispatch, None
        dispatch.close()
        return Finishing(self.live, self.grow, bool(run.cfg.train.save_final))

    def train(self, run) -> None:
        cfg, rec, h, dispatch, ckpt = run.cfg, run.record, run.history, self.live.dispatch, run.checkpoints
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        first = self.first
        if first >= cfg.train.steps or run.early.stopped:
            return
        left = cfg.train.steps - first
        run.startup.stage("first_step", f"training {left} step{'s' if left != 1 else ''}"
                          + (f" from step {first}" if first else "")
                          + (f" (the first compiles the blocks: torch.compile, {cfg.train.compile_backend})"
                             if cfg.train.compile else ""))
        bar = tqdm(range(first, cfg.train.steps), desc="train", unit="step", disable=not run.progress,
                   mininterval=1.0, dynamic_ncols=True, initial=first, total=cfg.train.steps)
        plans: dict[int, dict] = {}
        rollouts = run.driver_side  # online RL: each step's rows come from the rollouts, made after the step before

        def plan(k: int) -> dict:
            due = run.evaluates(k)
            where = ckpt.plan(k) if ckpt is not None else None
            if where is None and ckpt is not None and due and run.early.may_stop_next():
                where = ckpt.plan(k, force=True)  # this evaluation may end the run: commit what it saw
            if where and self.grow is None and k + 1 < cfg.train.steps:
                to = run.scaling.grow_to(rec.world, run.free_ranks()) if rec.world < run.scaling.start() else None
                if to is not None:  # resources are back: stop after this checkpoint and regroup
                    self.grow = Grow(k, rec.world, to)
            plans[k] = {"step": k, "lr": lr_at(k, rec.schedule_steps, cfg.optim), "checkpoint": where,
                        "evaluate": due, "evaluate_first": k == 0 and run.eval_at_start,
                        # every rank's memory ledger, for the summary: where the run may end
                        "ledgers": k + 1 == cfg.train.steps or (due and bool(run.early.patience))}
            if rollouts is not None:
                plans[k]["rollout"] = rollouts.plan(k, self.live.group, run.checkpoints)
            return plans[k]

        last = time.perf_counter()
        pending = dispatch.submit(plan(first))
        for step in bar:
            rec.step = step
            run.check_interrupt()
            stops_here = self.grow is not None and self.grow.step == step
            more = step + 1 < cfg.train.steps and not stops_here
            # Queue the next iteration before reading this one: ranks never wait on the driver;
            # except after an evaluation that may end the run, which must be read first.
            hold = bool(run.early.patience) and plans.pop(step)["evaluate"] or rollouts is not None
            queued = dispatch.submit(plan(step + 1)) if more and not hold else None
            results = dispatch.collect(pending, queued=queued is not None)
            run.startup.part("torch_compile", max(r["phase_s"].get("torch_compile", 0.0) for r in results))
            run.startup.first_step()
            now = time.perf_counter()
            dt, last = now - last, now
            stop = self.record_step(run, step, results, dt, tokens_per_step)
            bar.set_postfix(loss=f"{h.losses[-1]:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
            if stop or (self.grow is not None and self.grow.step == step):
                bar.close()
                return
            if hold and more:
                queued = dispatch.submit(plan(step + 1))
            pending = queued

    def record_step(self, run, step: int, results: list[dict], dt: float, tokens_per_step: int) -> bool:
        """One iteration's results into the history, MLflow and the checkpoints. True when
        early stopping ends the run after it. `results`: one per rank or per node (see
        `CompiledDispatch`), merged here into one, which reads as a rank's result does."""
        cfg, rec, h, early = run.cfg, run.record, run.history, run.early
        result = merge(results)
        results = [result]
        phase = {p: max(r["phase_s"][p] for r in results) for p in PHASES}  # the slowest rank's
        build = rec.build
        metrics = step_metrics(results, phase, dt, tokens_per_step, rec.world,
                               throughput(tokens_per_step / dt, rec.world, build["flops_per_token"],
                                          build["device_name"]),
                               cfg.train.global_batch_size // cfg.train.micro_batch_size, run.objective)
        h.record(step, metrics["loss"], dt, phase)
        stop = False
        if "val0_loss_sum" in results[0]:  # before the first step: the curve's baseline, at step -1
            base = val_loss(results, "val0_")
            run.log_val(-1, base, None, results[0].get("val0_objective"), val_count(results, "val0_"))
            early.observe(-1, base)
        if "val_loss_sum" in results[0]:
            val = val_loss(results, "val_")
            run.log_val(step, val, metrics, results[0].get("val_objective"), val_count(results, "val_"))
            stop = early.observe(step, val)
            if stop:
                log.warning("stopping early after step %d: %s", step, early.stopped)
                run.tracker.set_tags({"stopped_early": f"after step {step}: {early.stopped}"})
        if run.driver_side is not None:
            metrics.update(run.driver_side.step_metrics(step))
        h.skipped += int(results[0]["skipped"])
        h.memory = per_rank_ledgers(result) or [result["memory"]]  # the per-rank ones where the run may end
        if step == self.first:
            metrics["world_size"] = rec.world
        if step == 0 or step + 1 == cfg.train.steps or stop:
            metrics.update(memory_metrics(h.memory, build["params_per_rank"]))
        ckpt = run.checkpoints
        if ckpt is not None:
            metrics["checkpoint_stall_ms"] = max(r["phase_s"].get("checkpoint", 0.0) for r in results) * 1e3
            before = ckpt.last_committed
            record = {"early_stopping": early.state()}
            if run.driver_side is not None and results[0].get("checkpointed"):
                record["rollouts"] = run.driver_side.state()  # the rounds in flight: generated from weights gone
            if "val_loss" in metrics:
                record["metrics"] = {"val_loss": metrics["val_loss"]}
            ckpt.collect(step, results, record)
            if ckpt.last_committed != before:
                run.tracker.set_tags({"checkpoint": ckpt.last_committed})
        if step == self.first:
            recovered = run.clock.done()
            if recovered is not None:
                metrics["recovery_s"] = recovered
            if run.spares is not None:
                run.spares.settle()  # the spares that replaced lost ranks, replenished now
        run.tracker.log_metrics(step, metrics)
        run.add_row({"step": step, "world_size": rec.world, **metrics})
        return stop


def val_loss(results: list[dict], prefix: str) -> float:
    return sum(r[f"{prefix}loss_sum"] for r in results) / max(sum(r[f"{prefix}tokens"] for r in results), 1)


def val_count(results: list[dict], prefix: str) -> float:
    return sum(r[f"{prefix}tokens"] for r in results)


def val_values(objective, val: float, sums: dict | None = None, count: float = 0.0) -> dict[str, float]:
    """A validation's metrics: its loss, its perplexity where the objective's loss is a mean
    cross-entropy (next-token), and the objective's metrics (DPO's pairs' by TRL's names), `val_`
    before each."""
    out = {"val_loss": val}
    if objective.perplexity:
        out["val_perplexity"] = math.exp(min(val, 700.0))
    if sums:
        out.update(objective.step_metrics(sums, count, "val_"))
    return out


@dataclass(frozen=True)
class Grow:
    """A planned regrouping: after the commit at `step`, from `world` ranks to `to`."""

    step: int
    world: int
    to: int


# -- after training ---------------------------------------------------------------------------
@dataclass(repr=False)
class Finishing(State):
    """The group's last uploads and their commit; then either the final weights (the run is
    done) or, when it stopped to grow, the regrouping."""

    live: Live
    grow: Grow | None
    saves_final: bool = False  # train.save_final: the final weights are written after the uploads
    code = "FINISH"

    @property
    def doing(self) -> str:
        final = self.grow is None and self.saves_final
        return "finishing the checkpoint uploads" + (" and writing the final weights" if final else "")

    def next(self, run) -> State:
        cfg, ckpt, group = run.cfg, run.checkpoints, self.live.group
        if ckpt is not None:
            reports = group.call("finish_checkpoints")
            before = ckpt.last_committed
            ckpt.add_uploads([u for r in reports for u in r])
            if ckpt.last_committed != before:
                run.tracker.set_tags({"checkpoint": ckpt.last_committed})
        if self.grow is not None:
            return Resizing(self.live, self.grow)
        if cfg.train.save_final:
            weights = group.call("full_state_dict")[0]
            spec = run.spec or make_spec(cfg, run.factory)
            save_final(spec, weights, cfg.train.save_final, cfg.train.save_format,
                       {"strategy": cfg.sharding.strategy,
                        MODEL_KEY: json.dumps(export_identity(run.record.build["model"]))},
                       tokenizer=lambda: dataset_tokenizer_files(run.data_path, cfg.checkpoint),
                       storage_cfg=cfg.checkpoint)
        return Done(self.live)


@dataclass(repr=False)
class Resizing(State):
    """Close the group politely (its commit is in) and place the bigger one."""

    live: Live
    grow: Grow
    code = "RESIZE"
    doing = "regrouping"

    def next(self, run) -> State:
        self.live.release(kill=False)
        g = self.grow
        run.record.resizes.append({"step": g.step + 1, "from": g.world, "to": g.to})
        log.info("growing from %d to %d ranks at step %d", g.world, g.to, g.step + 1)
        return Placing(g.to)


@dataclass(repr=False)
class Done(State):
    """Training is over and everything is saved; the group is released by the controller."""

    live: Live | None
    code = "DONE"
    doing = "finishing"
