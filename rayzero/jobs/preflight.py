"""What is found before anything starts: whether the run resumes (and from what, said at its
start), whether anything is left to train, whether a local Ray would fit this machine; and the
libraries' start-up notes kept out of a run's output."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import ray
import torch

from rayzero.storage import StorageError
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.history import load_rows
from rayzero.config import ConfigError, RootConfig
from rayzero.models import ModelSpec
from rayzero.objectives.config import objective_difference, objective_record
from rayzero.workers.assembly import build_model, identity


class _DropNotice(logging.Filter):
    """Drops the log records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_logs() -> None:
    """Keep the libraries' routine start-up notes out of a run's output: Ray's note that token
    authentication is on (its warning that it is off stays), and MLflow's creation of a new
    sqlite store's tables; and Ray's own account of a rank process that died (`_worker_deaths`).
    Idempotent."""
    ray_auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropNotice) for f in ray_auth.filters):
        ray_auth.addFilter(_DropNotice("Token authentication is enabled"))
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _worker_deaths()


# How the raylet tells a driver that one of its worker processes died (killed, crashed): a
# paragraph guessing at causes ("... killed by SIGKILL by OOM killer due to high memory usage
# ...") printed to stdout, while the controller says which rank died, at what step, and what it
# does about it, in its own words (`failure (rank_died): ...`).
WORKER_DIED = ("A worker died or was killed while executing a task", "Worker unexpectedly exits with a connection error")


def _worker_deaths() -> None:
    """Ray's driver prints the raylet's error messages through `print_to_stdstream`, looked up
    by name when one arrives: the raylet's report of a dead worker goes to the log at debug
    level instead (Ray's other messages print as they would). Installed once."""
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "keeps_out_worker_deaths", False):
        return

    def printing(data, ignore_prefix):
        if data.get("pid") == "raylet":
            dropped = [line for line in data.get("lines", []) if any(m in line for m in WORKER_DIED)]
            for line in dropped:
                logging.getLogger(__name__).debug("Ray: %s", line)
            if dropped:
                data = {**data, "lines": [line for line in data["lines"] if line not in dropped]}
                if not data["lines"]:
                    return None
        return original(data, ignore_prefix)

    printing.keeps_out_worker_deaths = True
    ray_worker.print_to_stdstream = printing


def starts_local_ray(cfg: RootConfig) -> bool:
    """Whether a run of `cfg` from here starts a Ray of its own on this machine (no
    `cluster.address`, no RAY_ADDRESS, none running in this process)."""
    return not cfg.cluster.address and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized()


def local_capacity() -> dict[str, float]:
    """The CPUs and GPUs a local Ray started here gets (Ray's own count, cgroup limits included)."""
    try:
        from ray._private.utils import get_num_cpus

        cpus = float(get_num_cpus())
    except Exception:  # noqa: BLE001 (Ray's internals moved: count the CPUs this process may use)
        cpus = float(len(os.sched_getaffinity(0)))
    return {"CPU": cpus, "GPU": float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0}


def check_local_capacity(cfg: RootConfig) -> None:
    """A run that starts its own Ray must fit this machine: otherwise placement would only
    fail after `cluster.placement_timeout_s`. ConfigError naming what is asked and what there is."""
    c = cfg.cluster
    have = local_capacity()
    smallest = min(cfg.world_sizes())
    need = {"CPU": c.cpus_per_worker, **({"GPU": 1.0} if c.use_gpu else {})}
    for kind, each in need.items():
        if smallest * each > have[kind] + 1e-9:
            ask = (f"cluster.num_workers={c.num_workers} x {each:g} {kind}"
                   + (" (cluster.cpus_per_worker)" if kind == "CPU" else " each (cluster.use_gpu)"))
            fits = int(have[kind] / each + 1e-9)
            fewer = (f"use at most {fits} worker{'s' if fits != 1 else ''}"
                     + (", or a smaller cluster.cpus_per_worker" if kind == "CPU" else ""))
            raise ConfigError(
                f"cluster.num_workers: {ask} = {c.num_workers * each:g} {kind}s, but this machine's local Ray has "
                f"{have[kind]:g}; {fewer + ', or ' if fits else ''}set cluster.address to run on a Ray cluster")


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
        why = objective_difference(found[0].manifest.get("objective"), objective_record(checkpoints.cfg, now["model"]))
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


def say_resume(cfg: RootConfig, resume) -> None:
    """Where the run picks up, and what happens to a schedule the run outgrew, at its start."""
    from rayzero.cluster.schedule import schedule_length

    print(f"rayzero: resuming from {resume.uri} at step {resume.step} of {cfg.train.steps}", file=sys.stderr)
    total = schedule_length(cfg.train.steps, cfg.optim, resume.manifest)
    if total < cfg.train.steps:
        print(f"rayzero: warning: train.steps={cfg.train.steps} runs past the learning-rate schedule this run started "
              f"with ({total} steps): from step {total - 1} on the learning rate stays at its final value "
              f"{cfg.optim.final_lr:g}; optim.schedule_total=new stretches the schedule to {cfg.train.steps} steps "
              "instead", file=sys.stderr)
    elif total > cfg.train.steps:
        print(f"rayzero: note: train.steps={cfg.train.steps} ends before the learning-rate schedule this run started "
              f"with ({total} steps) has decayed; optim.schedule_total=new fits it to {cfg.train.steps} steps",
              file=sys.stderr)


def resumed_run_dir(resume) -> Path | None:
    """The run directory of the run being resumed, where it is on this machine: its MLflow
    store and its history go on there."""
    where = ((resume.manifest.get("run") or {}).get("dir") if resume is not None else None)
    if where and Path(where).is_dir():
        return Path(where)
    return None
