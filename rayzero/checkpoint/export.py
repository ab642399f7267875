"""Export adapters: the final consolidated weights as one safetensors file."""

from __future__ import annotations

import posixpath
from pathlib import Path

import pyarrow.fs as pafs
import torch
from safetensors.torch import save


def save_safetensors(state: dict[str, torch.Tensor], uri: str, metadata: dict[str, str] | None = None) -> None:
    """Write `state` to a local path or any `pyarrow.fs` URI (s3://…), atomically for local paths."""
    blob = save({k: v.contiguous() for k, v in state.items()}, metadata=metadata)
    if "://" not in uri:
        path = Path(uri).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)
        return
    fs, p = pafs.FileSystem.from_uri(uri)
    fs.create_dir(posixpath.dirname(p), recursive=True)
    with fs.open_output_stream(p) as f:
        f.write(blob)
