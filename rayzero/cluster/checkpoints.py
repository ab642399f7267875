"""The driver's side of checkpointing: when to save, committing manifests, pruning, and
picking what a run resumes from. Only the controller writes manifests."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from rayzero.objectives.registry import objective_record
from rayzero.checkpoint.manifest import (
    FORMAT, VERSION, CheckpointError, Committed, best_commit, check_model, check_shards_present, committed,
    different_model, lineage, model_differences, open_checkpoint, prune, step_dir, write_manifest,
)
from rayzero.checkpoint.stages import whole_build
from rayzero.storage import Storage, StorageError
from rayzero.config import RootConfig

log = logging.getLogger(__name__)


class CheckpointNotShared(RuntimeError):
    """A local checkpoint directory the ranks' nodes do not share: shards a rank wrote on its own
    node are not where the driver commits them. (Not retried: a new group would write its shards
    where it is placed again.)"""


def checkpoint_root(cfg: RootConfig) -> str:
    """`checkpoint.dir` as a URI: relative local paths live under `train.output_dir`."""
    d = cfg.checkpoint.dir
    if "://" in d or Path(d).expanduser().is_absolute():
        return d
    return str(Path(cfg.train.output_dir).expanduser().resolve() / d)


class Checkpoints:
    def __init__(self, cfg: RootConfig):
        self.cfg = cfg
        self.root = Storage(checkpoint_root(cfg), cfg.checkpoint)
        self.pending: dict[int, dict] = {}  # step -> {"uploads": [...], "lr": ..., ...}
        self.saving_ranks = 0
        self.layout: dict = {}
        self.params: list[dict] = []
        self.frozen: list[str] = []
        self.model: dict | None = None
        self.mlflow_run_id: str | None = None
        self.ask_run_id: Callable[[], str | None] | None = None  # see `configure`
        # Where this run keeps the rest of itself (data path, run directory, MLflow store): the
        # controller fills it in, the manifest records it, a resume finds them again.
        self.run: dict = {}
        # This run's id, kept by its resumes: pruning and a rebuilt group's resume see only its
        # own checkpoints, whatever else shares the directory (`checkpoint.resume=none` there).
        self.lineage = uuid.uuid4().hex[:16]
        self.own: set[str | None] = {self.lineage}
        self.schedule_steps = cfg.train.steps  # the learning-rate schedule's length in use
        self.last_committed: str | None = None
        self.best: Committed | None = None  # keep_best: the best commit under the root
        self.commits = 0

    def probe(self) -> None:
        """A write, read and delete at the checkpoint root: StorageError with the cause."""
        self.root.probe()

    def configure(self, infos: list[dict], mlflow_run_id: str | Callable[[], str | None] | None) -> None:
        """For a new group of ranks (the first, or one rebuilt after a failure or a resize):
        uploads the previous group left unfinished are dropped, uncommitted. With pipeline
        stages, the whole model's names and every stage's layout (`whole_build`).
        `mlflow_run_id`: the MLflow run a rerun goes on with, or how to ask for it: asked at each
        commit until it is known (MLflow may start after training has: `Tracker.begin`)."""
        self.pending = {}
        self.saving_ranks = sum(1 for i in infos if i["saves_shard"])
        whole = whole_build(infos)
        self.layout = whole["layout"]
        self.params = [{"name": n, "shape": s} for n, s in whole["params"].items()]
        self.frozen = whole.get("frozen", [])
        self.model = whole.get("model")
        self.ask_run_id = mlflow_run_id if callable(mlflow_run_id) else None
        self.mlflow_run_id = None if callable(mlflow_run_id) else mlflow_run_id

    def plan(self, step: int, force: bool = False) -> dict | None:
        """For iteration `step` (0-based): where to save after it, if it is a checkpoint step
        (or `force`: the run may end there)."""
        done, every, total = step + 1, self.cfg.checkpoint.every_steps, self.cfg.train.steps
        if force or done == total or (every and done % every == 0):
            return {"uri": self.root.child(step_dir(done)).uri, "step": done}
        return None

    def adopt(self, manifest: dict) -> None:
        """Resuming from `manifest`: its run's lineage is this run's from now on."""
        inherited = lineage(manifest)
        self.own |= {inherited}
        if inherited is not None:
            self.lineage = inherited

    def collect(self, step: int, results: list[dict], record: dict | None = None) -> None:
        """Reports from one iteration's results; commits every checkpoint now complete.
        `record`: what the manifest of a checkpoint taken after this step also keeps (the
        validation loss, early stopping's state)."""
        if results[0].get("checkpointed"):  # the ranks took a checkpoint after this step
            entry = self.pending.setdefault(step + 1, {"uploads": []})
            entry["loss_scale"] = results[0]["loss_scale"]
            entry["lr"] = results[0]["lr"]
            entry["record"] = record or {}
        self.add_uploads([u for r in results for u in r["uploads"]])

    def add_uploads(self, uploads: list[dict]) -> None:
        for u in uploads:
            self.pending.setdefault(u["step"], {"uploads": []})["uploads"].append(u)
        for step in sorted(self.pending):
            if len(self.pending[step]["uploads"]) == self.saving_ranks and "lr" in self.pending[step]:
                self._commit(step, self.pending.pop(step))

    def _commit(self, step: int, entry: dict) -> None:
        cfg = self.cfg
        if self.mlflow_run_id is None and self.ask_run_id is not None:
            self.mlflow_run_id = self.ask_run_id()
        shards = sorted(entry["uploads"], key=lambda u: u["rank"])
        manifest = {
            "format": FORMAT, "version": VERSION, "step": step,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": cfg.model.model_dump(), "block_size": cfg.block_size,
            "model_source": self.model,
            # the objective, and the reference model a preference loss measures against (rebuilt, not stored)
            "objective": objective_record(cfg, self.model),
            "params": self.params,
            "frozen": self.frozen,
            "layout": self.layout,
            # `pp_rank`: the stage whose layout (`layout["stages"]`) the shard's pieces are in
            "shards": [{**{k: u[k] for k in ("rank", "tp_rank", "file", "size", "block", "sha256", "pieces")},
                        "pp_rank": u.get("pp_rank", 0), **({"ep_rank": u["ep_rank"]} if "ep_rank" in u else {})}
                       for u in shards],
            "optimizer": {"name": "adamw", "step_count": shards[0]["adam_steps"]},
            "schedule": {"step": step, "total_steps": self.schedule_steps, "lr": entry["lr"],
                         "name": cfg.optim.schedule},
            "data": {"seed": cfg.train.seed, "global_batch_size": cfg.train.global_batch_size,
                     "seq_len": cfg.train.seq_len, "position": step, "path": self.run.get("data_path")},
            "loss_scale": entry["loss_scale"],
            "mlflow_run_id": self.mlflow_run_id,
            "run": {"lineage": self.lineage, **{k: v for k, v in self.run.items() if k != "data_path"}},
            **entry.get("record", {}),
        }
        prefix = self.root.child(step_dir(step))
        self._check_shared(prefix, shards)
        write_manifest(prefix, manifest)
        self.last_committed = prefix.uri
        self.commits += 1
        keep_best = cfg.checkpoint.keep_best
        try:  # the commit stands; failing to tidy up older ones is only worth a warning
            gone = prune(self.root, cfg.checkpoint.keep_last, own=self.own, keep_best=keep_best)
            if keep_best:
                self.best = best_commit([c for c in committed(self.root) if lineage(c.manifest) in self.own], keep_best)
        except StorageError as e:
            log.warning("could not prune old checkpoints under %s: %s", self.root.uri, e)
            gone = []
        log.info("committed checkpoint %s%s", prefix.uri, f"; removed {', '.join(gone)}" if gone else "")

    def _check_shared(self, prefix: Storage, shards: list[dict]) -> None:
        """On a local path, every rank's shard is where the driver commits it, whole: a
        directory local to each node (not a shared filesystem) would commit shards a resume cannot
        find. (In S3 every node writes to the same store.)"""
        if self.root.uri.startswith("s3://"):
            return
        unseen = [u["rank"] for u in shards if prefix.size(u["file"]) != u["size"]]
        if unseen:
            ranks = ", ".join(str(r) for r in unseen)
            raise CheckpointNotShared(
                f"checkpoint.dir {self.root.uri} is not one directory for every node: the shard"
                f"{'s' if len(unseen) > 1 else ''} of rank{'s' if len(unseen) > 1 else ''} {ranks} (written on "
                f"{'their' if len(unseen) > 1 else 'its'} own node) {'are' if len(unseen) > 1 else 'is'} not in "
                f"{prefix.uri} on the driver's node; give checkpoint.dir a path every node sees (a shared filesystem "
                "at the same path) or an s3:// one")

    @property
    def resume_mode(self) -> str:
        """`checkpoint.resume`, until this run commits: then `auto` (its own newest commit)."""
        return "auto" if self.commits else self.cfg.checkpoint.resume

    def resume_target(self, params: dict[str, list[int]], frozen: list[str] | None = None,
                      model: dict | None = None) -> list[Committed]:
        """What to resume from, best first (auto: the newest commit of this model first, then
        older ones to fall back on). Empty: start from scratch. A directory whose checkpoints
        are all of another model is an error naming both. Once this run has committed, a
        rebuilt group resumes from its own newest commit, whatever `checkpoint.resume` named."""
        how = self.resume_mode
        if how == "none":
            return []
        if how == "auto":
            try:
                found = committed(self.root)[::-1]
            except StorageError as e:
                raise CheckpointError(f"checkpoint.dir: {e}") from None
            if self.commits:
                found = [c for c in found if lineage(c.manifest) in self.own]
        else:
            found = [open_checkpoint(how, self.cfg.checkpoint)]
        frozen = frozen if frozen is not None else self.frozen
        model = model if model is not None else self.model
        same = [c for c in found if not model_differences(c.manifest, params, frozen, model)]
        if found and not same:
            first = found[0]
            where = f"checkpoint.dir {self.root.uri}" if how == "auto" else first.uri
            problems = model_differences(first.manifest, params, frozen, model)
            raise different_model(where, first.manifest, problems, model)
        if len(same) < len(found):
            log.warning("passing over %d checkpoint(s) of another model in %s", len(found) - len(same), self.root.uri)
        usable = []
        for c in same:
            try:
                check_shards_present(c)
            except CheckpointError as e:
                if how != "auto":
                    raise
                log.warning("skipping checkpoint %s: %s", c.uri, e)
                continue
            check_model(c.manifest, params, c.uri, frozen, model)  # warns of another config with the same shapes
            usable.append(c)
        return usable
