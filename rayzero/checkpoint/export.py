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

import pyarrow.fs as pafs
import torch
from safetensors.torch import save

from rayzero.storage import Storage, StorageError, destination, filesystem


def check_destination(uri: str, storage_cfg=None) -> None:
    """Fail now, not after training, if `uri` cannot be written: an unknown scheme, a local
    folder that cannot be created or written, S3 that a probe write beside `uri` does not reach
    (endpoint, keys, bucket). Raises ValueError saying why."""
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
        filesystem(uri, storage_cfg)
        if uri.startswith("s3://"):
            root = uri.rstrip("/")
            Storage(root.rsplit("/", 1)[0] if root.count("/") > 2 else root, storage_cfg).probe()
    except StorageError as e:
        raise ValueError(str(e)) from None


MODEL_KEY = "rayzero_model"  # the safetensors metadata key naming the model an export holds


def export_identity(record: dict) -> dict:
    """What tells one model's export from another's: its kind, source and config hash
    (`ModelSpec.record()`), written into the export's safetensors metadata."""
    return {k: record.get(k) for k in ("kind", "source", "config_sha256")}


def read_export_identity(uri: str, fmt: str, storage_cfg=None) -> dict | None:
    """The model an existing export at `uri` holds (its `export_identity`), {} where something
    is there that does not say (not a rayzero export), None where nothing is."""
    fs, path = filesystem(uri, storage_cfg)
    if fmt in ("hf", "peft"):  # a directory: its (first) weights file says
        if fs.get_file_info(path).type != pafs.FileType.Directory:
            return None if fs.get_file_info(path).type == pafs.FileType.NotFound else {}
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(path)) if i.base_name.endswith(".safetensors")]
        if not names:
            entries = fs.get_file_info(pafs.FileSelector(path))
            return {} if entries else None
        path = posixpath.join(path, sorted(names)[0])
    elif fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    try:
        with fs.open_input_file(path) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(f.size() - 8, 100 * 2**20):  # no safetensors header is that long
                return {}
            head = json.loads(f.read(n))
        return json.loads(head.get("__metadata__", {}).get(MODEL_KEY, "{}"))
    except (OSError, ValueError, struct.error):
        return {}


def check_final(uri: str, fmt: str, identity: dict, overwrite: bool, storage_cfg=None) -> None:
    """`train.save_final` must not replace an export of another model, unless told to:
    ValueError naming both. The same model's export (a rerun) is rewritten."""
    there = read_export_identity(uri, fmt, storage_cfg)
    if there is None or there == identity or overwrite:
        return
    held = (f"an export of {there.get('kind')} model {there.get('source') or '(no source)'} (config "
            f"{there.get('config_sha256')})" if there else "files rayzero did not write")
    raise ValueError(f"it already holds {held}, and this run trains {identity.get('kind')} model "
                     f"{identity.get('source') or '(no source)'} (config {identity.get('config_sha256')}); "
                     "write elsewhere, or set train.overwrite_final=true to replace it")


def save_safetensors(state: dict[str, torch.Tensor], uri: str, metadata: dict[str, str] | None = None,
                     storage_cfg=None) -> None:
    """Write `state` to a local path or any `pyarrow.fs` URI (s3://…), atomically for local paths."""
    blob = save({k: v.contiguous() for k, v in state.items()}, metadata=metadata)
    if "://" not in uri:
        path = Path(uri).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)
        return
    fs, p = destination(uri, storage_cfg)
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


def _swap_in(tmp: Path, final: Path) -> None:
    """Put the complete directory `tmp` where `final` is: the old one out of the way first,
    then a rename, so `final` is never a half-written export."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        import shutil

        shutil.rmtree(old, ignore_errors=True)


def write_hf_dir(uri: str, tensors: list[Tensor], files: dict[str, bytes], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None, stem: str = "model", storage_cfg=None) -> list[str]:
    """A Hugging Face model directory at `uri` (local or any `pyarrow.fs` URI): `tensors` in
    safetensors files of at most `max_shard_bytes` each (`model.safetensors`, or
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`), and `files`
    (config.json, tokenizer files, ...) as they are; `stem="adapter_model"` names the weights as
    PEFT's adapter directories do (`adapter_model.safetensors`). A local directory is written under a
    temporary name and renamed into place when complete; in object storage, where there is no
    rename, the index and config.json (without which transformers loads nothing) come last.
    Returns the files written."""
    if "://" not in uri:
        final = Path(uri).expanduser().resolve()
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        try:
            written = write_hf_dir(f"file://{tmp}", tensors, files, max_shard_bytes, metadata, stem)
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _swap_in(tmp, final)
        return written
    fs, root = destination(uri, storage_cfg, folder=True)
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    names = ([f"{stem}.safetensors"] if len(shards) == 1 else
             [f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for name, shard in zip(names, shards):
        stream_safetensors(fs, posixpath.join(root, name), shard, metadata)
    written = list(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        files = {f"{stem}.safetensors.index.json": json.dumps(index, indent=2).encode(), **files}
    for name in sorted(files, key=lambda n: n.endswith("config.json")):  # config.json last
        with fs.open_output_stream(posixpath.join(root, name)) as f:
            f.write(files[name])
        written.append(name)
    return written


def save_final(spec, weights: dict[str, torch.Tensor], uri: str, fmt: str, metadata: dict[str, str],
               dtype: str = "auto", max_shard_bytes: int = 5 * 10**9,
               tokenizer: Callable[[], dict[str, bytes]] | None = None, storage_cfg=None) -> None:
    """The final weights (`full_state_dict`, by `state_dict()` names) as `fmt`: one
    safetensors file, or (`hf`) a directory `from_pretrained` loads, LoRA adapters merged into
    their base weights; or (`peft`) the adapters alone. `tokenizer()`: the training data's
    tokenizer files, for a model directory that has no tokenizer of its own; `storage_cfg`:
    the S3 settings for `uri`."""
    lora = spec.cfg.lora
    if lora is not None:
        from rayzero.models.lora import lora_of, merge_weights

        adapters, saved = lora_of(spec, lora)
        if fmt == "peft":
            entries = peft_entries(adapters, saved, {n: tuple(v.shape) for n, v in weights.items()})
            write_peft_dir(uri, spec, lora, adapters, entries, lambda n, lo, hi: weights[n].reshape(-1)[lo:hi],
                           metadata, tokenizer, storage_cfg)
            return
        weights = merge_weights(base_as_stored(spec, weights, adapters, saved), adapters)
    if fmt == "safetensors":
        save_safetensors(weights, uri, metadata, storage_cfg)
        return
    dtype = spec.export_dtype(dtype)
    plan = spec.export_plan(spec.build())
    tensors = []
    for e in plan:
        if e.param is None:  # a buffer
            held = weights.get(e.name, e.buffer)
            tensors.append(Tensor(e.name, e.shape, _cast_dtype(held, dtype), lambda t=held: t))
            continue
        tensors.append(Tensor(e.name, e.shape, _cast_dtype(weights[e.param], dtype), lambda e=e: e.produce(
            lambda n: tuple(weights[n].shape), lambda n, lo, hi: weights[n].reshape(-1)[lo:hi])))
    write_hf_dir(uri, tensors, hf_files(spec, dtype, tokenizer), max_shard_bytes, metadata, storage_cfg=storage_cfg)


def hf_files(spec, dtype: str, tokenizer: Callable[[], dict[str, bytes]] | None = None) -> dict[str, bytes]:
    """What an HF directory holds beside the weights: the model's own files (config,
    generation config, tokenizer), and where the model directory has no tokenizer, the one
    the training data was made with, so that the export tokenizes as training did."""
    from rayzero.data.tokenizer import is_tokenizer_file

    files = spec.export_files(dtype)
    if tokenizer is not None and not any(is_tokenizer_file(n) for n in files):
        files = {**tokenizer(), **files}
    return files


def _cast_dtype(t: torch.Tensor, dtype: str) -> torch.dtype:
    """Floating tensors go out in the export dtype; others (integer buffers) as they are."""
    return EXPORT_DTYPES[dtype] if t.is_floating_point() else t.dtype


def base_as_stored(spec, weights: dict[str, torch.Tensor], adapters: dict, trained: list[str]) -> dict:
    """`weights` with the frozen base as the model's source holds it (`model.path`'s tensors in
    their own precision, as `ckpt export` reads them), not as the ranks computed with it (bf16
    compute rounds an fp32 base); as they are for a seeded base, or where the source cannot be
    read from here."""
    from rayzero.models import ModelError

    skip = {n for a in adapters.values() for n in (a.a, a.b)} | set(trained)
    model = spec.build()
    try:
        if spec.weights is None:  # a seeded base: no stored values to prefer
            return weights
        source = spec.source(model)
    except ModelError:
        return weights
    out = dict(weights)
    names = {id(p): n for n, p in model.named_parameters()}
    for key, v in model.state_dict(keep_vars=True).items():
        name = names.get(id(v))
        if name is None or key in skip or key not in out:
            continue
        value = torch.empty(tuple(v.shape), dtype=torch.float32)
        source.fill(name, value)
        out[key] = value
    return out


def peft_entries(adapters: dict, saved: list[str], shapes: dict[str, tuple]) -> list:
    """What a PEFT adapter directory holds: each adapter matrix and each saved module's
    parameter under the key PEFT gives it (`lora.peft_keys`)."""
    from rayzero.models.lora import peft_keys
    from rayzero.models.spec import ExportEntry

    return [ExportEntry(key, shapes[name], param=name) for key, name in peft_keys(adapters, saved).items()]


def write_peft_dir(uri: str, spec, settings, adapters: dict, entries: list, read: Callable,
                   metadata: dict[str, str] | None = None,
                   tokenizer: Callable[[], dict[str, bytes]] | None = None, storage_cfg=None) -> list[str]:
    """A PEFT adapter directory (`adapter_model.safetensors`, `adapter_config.json` naming
    the base model, `model.path`) that `peft.PeftModel.from_pretrained` loads onto the base;
    fp32, as PEFT keeps adapters. The tokenizer the model trained with goes beside them (the
    base's own, else `tokenizer()`: the training data's), so that `generate` and PEFT's users
    tokenize as training did without looking for the base's files."""
    from rayzero.models.lora import adapter_config

    shape_of = {e.param: e.shape for e in entries}.__getitem__
    tensors = [Tensor(e.name, e.shape, torch.float32, lambda e=e: e.produce(shape_of, read)) for e in entries]
    files = {**trained_tokenizer_files(spec, tokenizer),
             "adapter_config.json": adapter_config(settings, adapters, spec.cfg.path)}
    return write_hf_dir(uri, tensors, files, 2**62, metadata, stem="adapter_model", storage_cfg=storage_cfg)


def trained_tokenizer_files(spec, tokenizer: Callable[[], dict[str, bytes]] | None = None) -> dict[str, bytes]:
    """The tokenizer files of the model's directory (`model.path`), else `tokenizer()`'s."""
    from rayzero.data.tokenizer import is_tokenizer_file
    from rayzero.models import ModelError

    try:
        files = {n: b for n, b in spec.export_files("float32").items() if is_tokenizer_file(n)}
    except ModelError:  # a model with no directory of its own (the GPT, a module)
        files = {}
    if not files and tokenizer is not None:
        files = {n: b for n, b in tokenizer().items() if is_tokenizer_file(n)}
    return files
