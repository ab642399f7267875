"""Export adapters: consolidated weights as one safetensors file, or as a Hugging Face model
directory (safetensors split into shards with an index, config and tokenizer files), streamed
tensor by tensor."""

from __future__ import annotations

import json
import os
import posixpath
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its name, shape and dtype up front (the header is written first),
    and a function that produces its values when their turn comes (one tensor in memory at a
    time)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `2GiB` or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2) if m else "").upper() or "B"
    if not m or unit not in UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * UNITS[unit])


def _header(tensors: list[Tensor], metadata: dict[str, str] | None) -> bytes:
    head: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for t in tensors:
        head[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def stream_safetensors(fs: pafs.FileSystem, path: str, tensors: list[Tensor],
                       metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file, tensor by tensor: only one tensor is ever in memory."""
    with fs.open_output_stream(path) as f:
        f.write(_header(tensors, metadata))
        for t in tensors:
            values = t.produce().detach().to("cpu", t.dtype).contiguous()
            if tuple(values.shape) != tuple(t.shape):
                raise ValueError(f"{t.name}: produced shape {list(values.shape)}, expected {list(t.shape)}")
            f.write(memoryview(values.view(-1).view(torch.uint8).numpy()))


def _open_dir(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        path = Path(uri).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        return pafs.LocalFileSystem(), str(path)
    fs, p = pafs.FileSystem.from_uri(uri)
    fs.create_dir(p, recursive=True)
    return fs, p


def write_hf_dir(uri: str, tensors: list[Tensor], files: dict[str, bytes], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None) -> list[str]:
    """A Hugging Face model directory at `uri` (local or any `pyarrow.fs` URI): `tensors` in
    safetensors files of at most `max_shard_bytes` each (`model.safetensors`, or
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`), and `files`
    (config.json, tokenizer files, ...) as they are. The index and config are written last.
    Returns the files written."""
    fs, root = _open_dir(uri)
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for name, shard in zip(names, shards):
        stream_safetensors(fs, posixpath.join(root, name), shard, metadata)
    written = list(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        files = {"model.safetensors.index.json": json.dumps(index, indent=2).encode(), **files}
    for name in sorted(files, key=lambda n: n == "config.json"):  # config.json last
        with fs.open_output_stream(posixpath.join(root, name)) as f:
            f.write(files[name])
        written.append(name)
    return written


def save_final(spec, weights: dict[str, torch.Tensor], uri: str, fmt: str, metadata: dict[str, str],
               dtype: str = "auto", max_shard_bytes: int = 5 * 10**9) -> None:
    """The final weights (`full_state_dict`, by `state_dict()` names) as `fmt`: one
    safetensors file, or (`hf`) a directory `from_pretrained` loads."""
    if fmt == "safetensors":
        save_safetensors(weights, uri, metadata)
        return
    dtype = spec.export_dtype(dtype)
    plan = spec.export_plan(spec.build())
    tensors = [Tensor(e.name, e.shape, _cast_dtype(weights[e.name], dtype), lambda n=e.name: weights[n])
               for e in plan]
    write_hf_dir(uri, tensors, spec.export_files(dtype), max_shard_bytes, metadata)


def _cast_dtype(t: torch.Tensor, dtype: str) -> torch.dtype:
    """Floating tensors go out in the export dtype; others (integer buffers) as they are."""
    return EXPORT_DTYPES[dtype] if t.is_floating_point() else t.dtype
