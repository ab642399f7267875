"""What `rayzero ckpt` does: list, verify, and export committed checkpoints."""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from rayzero.checkpoint.export import (
    EXPORT_DTYPES, MODEL_KEY, Tensor, export_identity, hf_files, stream_safetensors, write_hf_dir, write_peft_dir,
)
from rayzero.checkpoint.manifest import CheckpointError, Committed, committed
from rayzero.checkpoint.shard_file import ShardReader, verify
from rayzero.checkpoint.shards import SavedIndex
from rayzero.checkpoint.stages import stage_layouts
from rayzero.models import ModelError, ModelSpec, spec_class, spec_from_manifest
from rayzero.models.spec import ExportEntry
from rayzero.storage import Storage, destination

log = logging.getLogger(__name__)


def list_checkpoints(uri: str, storage_cfg=None) -> list[dict]:
    """One row per committed checkpoint under `uri` (a checkpoint directory), oldest first."""
    rows = []
    for c in committed(Storage(uri, storage_cfg)):
        lay = c.manifest["layout"]
        rows.append({"uri": c.uri, "step": c.step, "bytes": sum(s["size"] for s in c.manifest["shards"]),
                     "world_size": lay["world_size"], "strategy": lay["strategy"], "pp": len(stage_layouts(lay)),
                     "created": c.manifest.get("created", "")})
    return rows


def verify_checkpoint(c: Committed) -> int:
    """Read every shard whole and check it against the manifest; returns the bytes checked."""
    for s in c.manifest["shards"]:
        verify(c.storage, s["file"], s)
    return sum(s["size"] for s in c.manifest["shards"])


class CheckpointWeights:
    """The fp32 main parameters of a committed checkpoint, read one parameter at a time by
    ranged reads of the shards that hold it; frozen parameters (never in a checkpoint) from
    the model's own source (its pretrained weights, or its seeded init)."""

    def __init__(self, c: Committed, storage_cfg=None):
        self.c = c
        m = c.manifest
        self.frozen = set(m.get("frozen", []))
        self.index = SavedIndex(m)
        self.readers: dict[int, ShardReader] = {}
        self.shapes = {p["name"]: tuple(p["shape"]) for p in m["params"]}
        self._source = None
        self._frozen: tuple[str | None, torch.Tensor | None] = (None, None)
        try:
            self.spec = spec_from_manifest(m, storage_cfg)
            self.model = self.spec.build()
        except ModelError as e:
            # A module whose factory this process cannot import (one defined in a notebook):
            # its parameters by their names, without buffers or tied aliases.
            if not spec_class(m["model"].get("kind")).exports_by_names() or self.frozen:
                raise CheckpointError(f"{c.uri}: cannot rebuild the model to export it: {e}") from None
            log.warning("%s; exporting the parameters by their names only", e)
            self.spec = self.model = None
        # LoRA: the plan is the base model's (its own names), each adapted weight read merged
        self.adapters, self.saved = ({}, [])
        if self.spec is not None and self.spec.cfg.lora is not None:
            from rayzero.models.lora import lora_of

            self.adapters, self.saved = lora_of(self.spec, self.spec.cfg.lora)
        self.read = self.read_saved
        if self.adapters:
            from rayzero.models.lora import merged_reader

            self.read = merged_reader(self.read_saved, self.shapes.__getitem__, self.adapters)

    def plan(self, fmt: str) -> list[ExportEntry]:
        """What the export writes: the model's own plan, or its parameters by name; `peft`:
        the LoRA adapters alone."""
        if fmt == "peft":
            if not self.adapters:
                raise CheckpointError(f"{self.c.uri}: --format peft writes LoRA adapters, and this checkpoint's "
                                      "run had none (model.lora)")
            from rayzero.checkpoint.export import peft_entries

            return peft_entries(self.adapters, self.saved, self.shapes)
        if self.spec is None:
            if fmt == "hf":
                raise CheckpointError(f"{self.c.uri}: an HF directory needs model.kind=hf")
            return [ExportEntry(n, shape, param=n) for n, shape in self.shapes.items()]
        if fmt == "hf":
            return self.spec.export_plan(self.model)
        return ModelSpec.export_plan(self.spec, self.model)

    def __call__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return self.read(name, 0, int(np.prod(shape, dtype=np.int64))).view(shape)

    def read_saved(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Flat elements [lo, hi) of parameter `name`, fp32, as trained (`read`: with LoRA
        adapters merged into their base weights): only the bytes of the shards that
        hold them (an export of a mixture of experts reads each expert's slice of a fused
        parameter this way, never the whole of it)."""
        if name in self.frozen:  # not in the checkpoint: from the model's source, whole (kept for its next slice)
            if self._frozen[0] != name:
                if self._source is None:
                    self._source = self.spec.source(self.model)
                out = torch.empty(self.shapes[name], dtype=torch.float32)
                self._source.fill(name, out)
                self._frozen = (name, out.view(-1))
            return self._frozen[1][lo:hi]
        m = self.c.manifest
        out = np.empty(hi - lo, dtype=np.float32)
        try:
            found = self.index.locate(name, lo, hi)
        except ValueError as e:
            raise CheckpointError(f"{self.c.uri}: {name}: {e}") from None
        for f, off, n, dst in found:
            if f not in self.readers:
                self.readers[f] = ShardReader(self.c.storage, m["shards"][f]["file"], m["shards"][f])
            out[dst : dst + n] = self.readers[f].read("main", off, off + n)
        return torch.from_numpy(out)


def consolidated_weights(c: Committed, storage_cfg=None) -> dict[str, torch.Tensor]:
    """The fp32 weights, whole, by the model's `state_dict()` names (a tied weight under each
    of its names), all in memory: for a small model in a notebook. `export_checkpoint`
    streams instead."""
    weights = CheckpointWeights(c, storage_cfg)
    return {e.name: weights(e.param) if e.param is not None else e.buffer.clone() for e in weights.plan("safetensors")}


def export_checkpoint(c: Committed, out: str, fmt: str = "safetensors", dtype: str = "auto",
                      max_shard_bytes: int = 5 * 10**9, storage_cfg=None) -> int:
    """Write a checkpoint's weights to `out`, streaming tensor by tensor (never the whole model
    in memory): `safetensors` = one file by `state_dict()` names, fp32 unless `dtype` says
    otherwise; `hf` = a directory `from_pretrained` loads (HF models only). Returns the number
    of tensors written."""
    weights = CheckpointWeights(c, storage_cfg)
    spec = weights.spec
    plan = weights.plan(fmt)
    metadata = {"step": str(c.step), "source": c.uri}
    if c.manifest.get("model_source"):
        metadata[MODEL_KEY] = json.dumps(export_identity(c.manifest["model_source"]))
    if fmt == "peft":
        write_peft_dir(out, spec, spec.cfg.lora, weights.adapters, plan, weights.read_saved, metadata,
                       lambda: data_tokenizer_files(c.manifest, storage_cfg), storage_cfg)
        return len(plan)
    dtype = spec.export_dtype(dtype) if fmt == "hf" else ("float32" if dtype == "auto" else dtype)
    tensors = []
    for e in plan:
        if e.param is not None:
            produce = (lambda e=e: e.produce(weights.shapes.__getitem__, weights.read))
            kind = EXPORT_DTYPES[dtype]
        else:
            produce = (lambda b=e.buffer: b)
            kind = EXPORT_DTYPES[dtype] if e.buffer.is_floating_point() else e.buffer.dtype
        tensors.append(Tensor(e.name, e.shape, kind, produce))
    if fmt == "hf":
        write_hf_dir(out, tensors, hf_files(spec, dtype, lambda: data_tokenizer_files(c.manifest, storage_cfg)),
                     max_shard_bytes, metadata, storage_cfg=storage_cfg)
    else:
        stream_safetensors(*destination(out, storage_cfg), tensors, metadata)
    return len(tensors)


def data_tokenizer_files(manifest: dict, storage_cfg=None) -> dict[str, bytes]:
    """The tokenizer files kept by the dataset a checkpoint's run trained on, where the
    manifest names it and it is still there (else none)."""
    from rayzero.data.errors import DataError
    from rayzero.data.tokens import dataset_tokenizer_files

    path = manifest.get("data", {}).get("path")
    if not path:
        return {}
    try:
        return dataset_tokenizer_files(path, storage_cfg)
    except (DataError, OSError):
        return {}
