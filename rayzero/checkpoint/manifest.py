"""The checkpoint format (version 1) and the catalog of a checkpoint directory.

    <dir>/step-000120/shard-00000-of-00004.safetensors   one per saving rank, written by it
    <dir>/step-000120/manifest.json                      written last, by the controller: the commit

A prefix without `manifest.json` is not a checkpoint: readers skip it and the controller
deletes it once a newer checkpoint is committed. With pipeline stages the manifest's `params`
are the whole model's, its `layout["stages"]` each stage's layout and each shard's `pp_rank`
the stage it was saved by (`stages.py`); a manifest without them is one stage's.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from rayzero.checkpoint.records import stored
from rayzero.models import spec_class
from rayzero.models.config import ModelConfig
from rayzero.storage import Storage, StorageError

log = logging.getLogger(__name__)

FORMAT, VERSION = "rayzero-checkpoint", 1
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message says why and names the files."""


class NotCommitted(CheckpointError):
    """A prefix without a manifest: an upload that never committed, not a checkpoint."""


def step_dir(step: int) -> str:
    return f"step-{step:06d}"


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its storage prefix and its manifest."""

    storage: Storage
    manifest: dict

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def uri(self) -> str:
        return self.storage.uri


def write_manifest(storage: Storage, manifest: dict) -> None:
    storage.write_bytes(MANIFEST, json.dumps(manifest, indent=1).encode())


def read_manifest(storage: Storage) -> dict:
    try:
        m = json.loads(storage.read_bytes(MANIFEST))
    except FileNotFoundError:
        raise NotCommitted(f"{storage.uri} is not a checkpoint (no {MANIFEST}: never committed)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{storage.uri}/{MANIFEST} is not valid JSON: {e}") from None
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise CheckpointError(f"{storage.uri}: format {m.get('format')} v{m.get('version')}, "
                              f"this rayzero reads {FORMAT} v{VERSION}")
    return m


def committed(root: Storage) -> list[Committed]:
    """The committed checkpoints under `root`, oldest first."""
    out = []
    for name in root.list_dirs():
        if not _STEP.match(name):
            continue
        try:
            out.append(Committed(root.child(name), read_manifest(root.child(name))))
        except NotCommitted:
            continue  # an upload that never committed: not a checkpoint
        except CheckpointError as e:  # a manifest that does not parse: damaged, say so
            log.warning("checkpoint %s is damaged (%s); passing over it", root.child(name).uri, e)
    return sorted(out, key=lambda c: c.step)


def open_checkpoint(uri: str, storage_cfg=None) -> Committed:
    """A checkpoint by URI: a `step-…` prefix, or a directory (its newest commit); `storage_cfg`:
    the S3 settings (`StorageSettings`, or the checkpoint config)."""
    storage = Storage(uri, storage_cfg)
    if _STEP.match(uri.rstrip("/").rsplit("/", 1)[-1]):
        return Committed(storage, read_manifest(storage))
    found = committed(storage)
    if not found:
        raise CheckpointError(f"{uri}: no committed checkpoint there")
    return found[-1]


def check_shards_present(c: Committed) -> None:
    """Every shard the manifest lists exists with its recorded size (cheap: no data read)."""
    for s in c.manifest["shards"]:
        size = c.storage.size(s["file"])
        if size != s["size"]:
            raise CheckpointError(f"{c.uri}/{s['file']}: " + ("missing" if size is None else
                                  f"{size} bytes, the manifest says {s['size']}"))


def recorded(record: dict | None) -> dict:
    """A model's record (`ModelSpec.record()`); for a checkpoint from before models were recorded,
    the default kind's."""
    return record or {"kind": ModelConfig.model_fields["kind"].default}


def model_differences(manifest: dict, params: dict[str, list[int]], frozen: list[str] | None = None,
                      model: dict | None = None) -> list[str]:
    """How the model a checkpoint holds differs from this one, tensor by tensor: its kind,
    parameter names and shapes, and which parameters are frozen (empty: the same model)."""
    saved = {p["name"]: p["shape"] for p in manifest["params"]}
    problems = []
    was = recorded(manifest.get("model_source"))
    if model is not None and was.get("kind") != model.get("kind"):
        problems.append(f"model.kind: {was.get('kind')} in the checkpoint, {model.get('kind')} here")
    problems += [f"{n}: missing from the checkpoint" for n in params if n not in saved]
    problems += [f"{n}: not in the model" for n in saved if n not in params]
    problems += [f"{n}: shape {saved[n]} in the checkpoint, {params[n]} in the model"
                 for n in params if n in saved and list(saved[n]) != list(params[n])]
    if frozen is not None and not problems:
        before = set(manifest.get("frozen", []))
        problems += [f"{n}: frozen here, trained in the checkpoint" for n in sorted(set(frozen) - before)]
        problems += [f"{n}: trained here, frozen in the checkpoint (model.freeze)" for n in sorted(before - set(frozen))]
    return problems


def describe_model(record: dict | None) -> str:
    """A model as a checkpoint records it (`ModelSpec.record()`), in a few words."""
    record = recorded(record)
    return spec_class(record.get("kind")).describe(record)


# Config entries that say nothing of the model itself (which library wrote it, from where).
_NOT_THE_MODEL = {"transformers_version", "_name_or_path", "_commit_hash", "dtype", "torch_dtype"}
DETAIL_LINES = 4


def what_differs(was: dict | None, now: dict | None) -> str | None:
    """What makes two models (`ModelSpec.record()`s) different, in a few words, where their
    records say: the kind, the LoRA settings, the config keys, the source; None where they say
    nothing (the same model, configured alike)."""
    was, now = stored(recorded(was)), stored(recorded(now))

    def pairs(a: dict, b: dict, prefix: str = "", skip=()) -> list[str]:
        keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in skip]
        out = [f"{prefix}{k} {_brief(a.get(k))} in the checkpoint, {_brief(b.get(k))} here" for k in keys[:3]]
        return out + ([f"and {len(keys) - 3} more"] if len(keys) > 3 else [])

    if was.get("kind") != now.get("kind"):
        return f"model.kind {was.get('kind')} in the checkpoint, {now.get('kind')} here"
    lora_was, lora_now = was.get("lora"), now.get("lora")
    if lora_was != lora_now:
        if not lora_was or not lora_now:
            return "LoRA adapters " + ("here, none in the checkpoint" if lora_now else "in the checkpoint, none here")
        return ", ".join(pairs(lora_was, lora_now, "model.lora."))
    config = pairs(was.get("config") or {}, now.get("config") or {}, skip=_NOT_THE_MODEL)
    if config:
        return ", ".join(config)
    for key, label in (("factory", "model.factory"), ("kwargs", "model.kwargs"), ("source", "model.path")):
        if was.get(key) != now.get(key):
            return f"{label} {_brief(was.get(key))} in the checkpoint, {_brief(now.get(key))} here"
    return None


def _brief(value) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def different_model(uri: str, manifest: dict, problems: list[str], model: dict | None) -> CheckpointError:
    """The error for resuming another model: one line leading with what differs (the config
    key, the LoRA setting, else the first tensor) and the two ways out; then both models, if
    their descriptions differ, and the first few tensor differences, one a line."""
    held, here = describe_model(manifest.get("model_source")), describe_model(model)
    lead = what_differs(manifest.get("model_source"), model)
    n = len(problems)
    if lead is not None:
        lead += f", so {n} tensor{'s differ' if n != 1 else ' differs'}"
    else:
        lead = problems[0] + (f" and {n - 1} more difference{'s' if n > 2 else ''}" if n > 1 else "")
    details = ([f"checkpoints of {held}; this run trains {here}"] if held != here else []) + problems[:DETAIL_LINES]
    return CheckpointError(
        f"{uri} holds a different model: {lead}; train it into another checkpoint.dir, or set "
        f"checkpoint.resume=none to start from scratch beside them"
        + "".join(f"\n  {p}" for p in details)
        + (f"\n  … and {n - DETAIL_LINES} more" if n > DETAIL_LINES else ""))


def check_model(manifest: dict, params: dict[str, list[int]], uri: str, frozen: list[str] | None = None,
                model: dict | None = None) -> None:
    """The checkpoint holds exactly these parameter names and shapes, of the same model kind,
    with the same parameters frozen; else a CheckpointError naming both models and listing
    every mismatch. A model of another config with the same shapes is only warned about."""
    problems = model_differences(manifest, params, frozen, model)
    if problems:
        raise different_model(uri, manifest, problems, model)
    was = recorded(manifest.get("model_source"))
    if model is not None and was.get("config_sha256") not in (None, model.get("config_sha256")):
        log.warning("%s was saved from a model of another config (%s) with the same parameter shapes; "
                    "resuming from it", uri, was.get("source") or was.get("kind"))


def lineage(manifest: dict) -> str | None:
    """The id of the run a checkpoint belongs to (kept across its resumes); None before it was recorded."""
    return (manifest.get("run") or {}).get("lineage")


def best_commit(done: list[Committed], metric: str = "val_loss") -> Committed | None:
    """The commit with the lowest `metric` among those that recorded one (the earliest on a tie)."""
    scored = [c for c in done if (c.manifest.get("metrics") or {}).get(metric) is not None]
    return min(scored, key=lambda c: (c.manifest["metrics"][metric], c.step)) if scored else None


def prune(root: Storage, keep_last: int, own: set | None = None, keep_best: str = "") -> list[str]:
    """Delete committed checkpoints beyond the newest `keep_last`, and uncommitted prefixes
    older than the newest commit (a crash mid-upload leaves those). Returns what went.

    `own`: the lineages (`lineage()`) of this run; checkpoints of other runs in the same
    directory are left alone. `keep_best`: a metric (`val_loss`) whose best commit is kept
    however old."""
    done = [c for c in committed(root) if own is None or lineage(c.manifest) in own]
    if not done:
        return []
    newest = done[-1].step
    keep = {step_dir(c.step) for c in done[-keep_last:]}
    best = best_commit(done, keep_best) if keep_best else None
    if best is not None:
        keep.add(step_dir(best.step))
    mine = {step_dir(c.step) for c in done}
    others = {n for n in root.list_dirs() if _STEP.match(n)} - mine if own is not None else set()
    others = {n for n in others if root.child(n).size(MANIFEST) is not None}  # another run's commits stay
    gone = []
    for name in root.list_dirs():
        m = _STEP.match(name)
        if m and name not in keep and name not in others and int(m.group(1)) < newest:
            try:
                root.delete_dir(name)
                gone.append(name)
            except StorageError as e:
                log.warning("could not delete old checkpoint %s: %s", name, e)
    return gone
