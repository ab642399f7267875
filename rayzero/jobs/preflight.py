"""What is found before anything starts: whether the run resumes (and from what, said at its
start) and whether anything is left to train. Whether a local Ray would fit this machine, and
Ray's start-up notes kept out of a run's output: `rayzero.cluster.local_ray`."""

from __future__ import annotations

import sys
from pathlib import Path

from rayzero.storage import StorageError
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.history import load_rows
from rayzero.config import ConfigError, RootConfig
from rayzero.models import ModelSpec
from rayzero.objectives.registry import objective_difference, objective_for, objective_record
from rayzero.workers.assembly import build_model, identity


class CheckpointsUnreadable(ConfigError):
    """checkpoint.dir names storage this process cannot read (unreachable, refused)."""


def resume_preview(checkpoints: Checkpoints, spec: ModelSpec, built=None):
    """The commit the run will resume from (None: it starts from scratch), chosen as the
    controller will choose it, before anything starts: a directory holding only another
    model's checkpoints is refused here, in one line, not after the cluster is up. `built`:
    the driver's build of the model (one TP rank's share of it, as the ranks build it), if
    it has one already."""
    built = built if built is not None else build_model(checkpoints.cfg, spec)
    now = identity(built.model, built.tp, spec)  # as the ranks report it: whole shapes, whatever the TP size
    try:
        found = checkpoints.resume_target(now["params"], now["frozen"], now["model"])
    except StorageError as e:
        raise CheckpointsUnreadable(f"checkpoint.dir: cannot read checkpoints there: {e}") from None
    if found:
        why = objective_difference(found[0].manifest.get("objective"), objective_record(checkpoints.cfg, now["model"]),
                                   getattr(objective_for(checkpoints.cfg), "resume_hint", ""))
        if why:
            raise ConfigError(f"checkpoint.dir: cannot resume {found[0].uri}: {why}")
    return found[0] if found else None


def nothing_to_train(cfg: RootConfig, resume) -> tuple[dict, list[dict]] | None:
    """A run whose checkpoint is already at `train.steps` (or that stopped early, with early
    stopping still on) has nothing to do: its summary and history, without starting Ray."""
    m = resume.manifest
    stopped = (m.get("early_stopping") or {}).get("stopped") if cfg.train.early_stopping_patience else None
    if resume.step < cfg.train.steps and not stopped:
        return None
    run = m.get("run") or {}
    summary = {
        "steps": 0, "start_step": resume.step, "total_steps": cfg.train.steps, "resumed_from": resume.uri,
        "checkpoint": resume.uri, "first_loss": None, "final_loss": None, "final_val_loss": None,
        "stopped_early": ({"step": m["early_stopping"].get("stopped_after"), "reason": stopped} if stopped else None),
        "run_dir": run.get("dir"), "mlflow_run_id": m.get("mlflow_run_id"),
        "mlflow_tracking_uri": run.get("mlflow_tracking_uri"), "final_weights": None, "restarts": 0,
        "failures": [], "resizes": [], "replacements": [], "world_size": None, "strategy": cfg.sharding.strategy,
    }
    rows = load_rows(Path(run["dir"]) / "history.jsonl") if run.get("dir") else []
    return summary, rows


def say_resume(cfg: RootConfig, resume, length: str | None = None) -> None:
    """Where the run picks up, and what happens to a schedule the run outgrew, at its start
    (`length`: the key that sets the run's length, `train.steps=N` or `data.epochs=E (N steps)`)."""
    from rayzero.cluster.schedule import schedule_length

    length = length or f"train.steps={cfg.train.steps}"
    print(f"rayzero: resuming from {resume.uri} at step {resume.step} of {cfg.train.steps}", file=sys.stderr)
    total = schedule_length(cfg.train.steps, cfg.optim, resume.manifest)
    if total < cfg.train.steps:
        print(f"rayzero: warning: {length} runs past the learning-rate schedule this run started with ({total} "
              f"steps): the schedule wins (optim.schedule_total=original), so from step {total - 1} on the learning "
              f"rate stays at its final value {cfg.optim.final_lr:g}; optim.schedule_total=new stretches the schedule "
              f"to {cfg.train.steps} steps instead", file=sys.stderr)
    elif total > cfg.train.steps:
        print(f"rayzero: note: {length} ends the run before the learning-rate schedule this run started with "
              f"({total} steps) has decayed: the schedule wins (optim.schedule_total=original), cut short at step "
              f"{cfg.train.steps}; optim.schedule_total=new fits it to {cfg.train.steps} steps", file=sys.stderr)


def resumed_run_dir(resume) -> Path | None:
    """The run directory of the run being resumed, where it is on this machine: its MLflow
    store and its history go on there."""
    where = ((resume.manifest.get("run") or {}).get("dir") if resume is not None else None)
    if where and Path(where).is_dir():
        return Path(where)
    return None
