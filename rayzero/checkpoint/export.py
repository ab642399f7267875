"""Export adapters: the final consolidated weights as one safetensors file."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import torch
from safetensors.torch import save


def check_destination(uri: str) -> None:
    """Fail now, not after training, if `uri` cannot be written: an unknown scheme, a local
    folder that cannot be created or written. Raises ValueError saying why."""
    if "://" not in uri:
        parent = Path(uri).expanduser().resolve().parent
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{parent} is a file, not a folder")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create {parent}: {e.strerror}") from None
        if not os.access(parent, os.W_OK):
            raise ValueError(f"{parent} is not writable")
        return
    try:
        pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        raise ValueError(str(e)) from None


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
