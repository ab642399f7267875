"""Pretrained weights in safetensors files, read by byte range: each rank reads only its shard.

A safetensors file is an 8-byte header length, a JSON header giving every tensor's dtype,
shape and byte offsets, then the raw tensors. So the headers alone (a few KiB, one ranged
read per file) say where every element of every parameter lies, and a rank fetches just the
bytes of the elements it keeps: through `pyarrow.fs`, the same for a local directory and
for S3. A model directory holds `model.safetensors`, or `model-*.safetensors` files listed
by `model.safetensors.index.json`.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import struct
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rayzero.storage import Storage, StorageError
from rayzero.models.conversions import Part
from rayzero.models.errors import ModelError, ModelUnavailable
from rayzero.sharding.flat_buffer import ParamSource, Piece

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})
READ_BYTES = 16 << 20  # one ranged request: object stores serve several of these at once
GAP_BYTES = 4 << 10  # pieces closer than this in a file are fetched in one request (a norm gain: 4 KiB)
READ_THREADS = 8


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class SafetensorsWeights(ParamSource):
    """The tensors of one or more safetensors files under a storage root, by name.

    `parts` says which tensors hold each model parameter's elements, and where (`resolve`
    matches by name; `use` takes what `conversions.load_layout` found for a model whose
    checkpoint layout differs); `fill_pieces` reads element ranges of parameters, converted to
    fp32, with adjacent ranges joined into one request and requests run in parallel."""

    partial = True

    def __init__(self, storage: Storage, tensors: dict[str, TensorInfo], fingerprint: str):
        self.storage = storage
        self.tensors = tensors
        self.fingerprint = fingerprint
        self.parts: dict[str, list[Part]] = {}  # parameter name -> the tensors that fill it (`use`)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()

    @classmethod
    def find(cls, uri: str, storage_cfg=None) -> "SafetensorsWeights | None":
        """The weights at `uri`: a safetensors file, or a directory holding `model.safetensors`
        or an index of shards. None if a directory holds neither; ModelError for files that
        are not safetensors, or an index naming a missing file."""
        uri = uri.rstrip("/")
        if uri.endswith(".safetensors"):
            root, name = uri.rsplit("/", 1) if "/" in uri else (".", uri)
            storage = Storage(root, storage_cfg)
            if storage.size(name) is None:
                raise ModelError(f"model.path: {uri} does not exist")
            return cls._open(storage, [name])
        storage = Storage(uri, storage_cfg)
        if storage.size(INDEX) is not None:
            try:
                index = json.loads(storage.read_bytes(INDEX))
                files = sorted(set(index["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as e:
                raise ModelError(f"model.path: {uri}/{INDEX} is not a safetensors index ({e})") from None
            missing = [f for f in files if storage.size(f) is None]
            if missing:
                raise ModelError(f"model.path: {uri}/{INDEX} lists {', '.join(missing)}, which "
                                 f"{'is' if len(missing) == 1 else 'are'} not there")
            return cls._open(storage, files)
        if storage.size(SINGLE) is not None:
            return cls._open(storage, [SINGLE])
        return None

    @classmethod
    def _open(cls, storage: Storage, files: list[str]) -> "SafetensorsWeights":
        tensors: dict[str, TensorInfo] = {}
        digest = hashlib.sha256()
        for f in files:
            size = storage.size(f)
            try:
                (n,) = struct.unpack("<Q", storage.read_range(f, 0, 8))
                if n > 100 << 20 or 8 + n > size:
                    raise ValueError(f"a header of {n} bytes")
                raw = storage.read_range(f, 8, n)
                header = json.loads(raw)
            except (ValueError, struct.error, StorageError) as e:
                raise ModelError(f"model.path: {storage.uri}/{f} is not a safetensors file ({e})") from None
            digest.update(f.encode() + raw + str(size).encode())
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in DTYPES:
                    raise ModelError(f"model.path: {storage.uri}/{f}: tensor {key} has dtype {meta['dtype']}; "
                                     f"weights must be one of {', '.join(DTYPES)}")
                tensors[key] = TensorInfo(f, meta["dtype"], tuple(meta["shape"]), 8 + n + meta["data_offsets"][0])
        return cls(storage, tensors, digest.hexdigest()[:16])

    # -- names ---------------------------------------------------------------------------
    def resolve(self, params: dict[str, tuple[int, ...]], prefix: str = "", aliases: set[str] = frozenset(),
                ignore: set[str] = frozenset()) -> None:
        """Match every model parameter (name -> shape) to a tensor in the files: by its name,
        or with the model's `prefix` (a checkpoint of the base model, as GPT-2's) taken away or
        added. ModelError listing every parameter that is missing or has another shape, and
        every tensor that belongs to no parameter (`aliases`: other names of parameters, such as
        a tied head; `ignore`: buffers and the like, which are not loaded)."""
        parts, unused = {}, []
        keys = {}
        for name in params:
            candidates = [name]
            if prefix:
                candidates += [name.removeprefix(prefix + "."), f"{prefix}.{name}"]
            key = next((c for c in candidates if c in self.tensors), None)
            if key is not None:
                keys[key] = name
                parts[name] = [Part.whole(key, self.tensors[key].shape)]
        strip = (lambda k: k) if not prefix else (lambda k: k.removeprefix(prefix + "."))
        allowed = {strip(a) for a in aliases | ignore}
        unused = [k for k in self.tensors if k not in keys and strip(k) not in allowed]
        self.use(parts, params, unused)

    def use(self, parts: dict[str, list[Part]], params: dict[str, tuple[int, ...]], unused: list[str]) -> None:
        """Take `parts` (which tensors fill each parameter, and where) after checking them:
        ModelError listing every parameter that is missing, has another shape or is not wholly
        covered, and every tensor (`unused`) that belongs to no parameter."""
        problems = []
        for name, shape in params.items():
            mine = parts.get(name)
            if not mine:
                problems.append(f"{name}: missing from the weights")
            elif len(mine) == 1 and mine[0].extent != tuple(shape):
                problems.append(f"{name}: shape {list(mine[0].extent)} in the weights, {list(shape)} in the model")
            elif sum(p.numel for p in mine) != _numel(shape):
                problems.append(f"{name}: the weights' {', '.join(p.key for p in mine[:3])}… cover "
                                f"{sum(p.numel for p in mine)} of its {_numel(shape)} elements")
        problems += [f"{k}: in the weights, not in the model" for k in sorted(unused)]
        if problems:
            shown = problems[:20] + ([f"… and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise ModelError(f"model.path: the weights in {self.storage.uri} do not match the model:\n  "
                             + "\n  ".join(shown))
        self.parts = {n: parts[n] for n in params}
        self.shapes = {n: tuple(shape) for n, shape in params.items()}

    def dtype(self) -> str:
        """The weights' dtype, as transformers names it (the most common one among the tensors)."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
        name = max(counts, key=counts.get) if counts else "F32"
        return {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(name, "float32")

    # -- reading -------------------------------------------------------------------------
    def fill(self, name: str, out: torch.Tensor) -> None:
        self.fill_pieces([Piece(name, 0, out.numel(), tuple(out.shape), out.view(-1))])

    def fill_pieces(self, pieces: list[Piece]) -> None:
        # Each piece as byte spans of at most READ_BYTES: (file, first byte, bytes, out, first element, dtype),
        # from each tensor that holds some of its elements (one, unless the checkpoint splits the parameter).
        spans = []
        for p in pieces:
            for part in self.parts[p.name]:
                info = self.tensors[part.key]
                per = READ_BYTES // info.itemsize
                for first, n, at in part.runs(self.shapes[p.name], p.start, p.end):
                    for lo in range(0, n, per):
                        k = min(per, n - lo)
                        spans.append((info.file, info.offset + (first + lo) * info.itemsize, k * info.itemsize,
                                      p.out, at + lo, info.dtype))
        # Spans near each other in a file become one request of up to READ_BYTES.
        jobs: list[list] = []  # [file, first byte, bytes, [(offset in the request, span)]]
        for span in sorted(spans, key=lambda s: (s[0], s[1])):
            f, start, n = span[:3]
            last = jobs[-1] if jobs else None
            if (last and last[0] == f and start - (last[1] + last[2]) <= GAP_BYTES
                    and start + n - last[1] <= READ_BYTES):
                last[2] = max(last[2], start + n - last[1])
                last[3].append((start - last[1], span))
            else:
                jobs.append([f, start, n, [(0, span)]])

        def run(job):
            f, start, n, parts = job
            data = self.storage.read_range(f, start, n)
            with self._lock:
                self.bytes_read += n
            view = memoryview(data)
            with warnings.catch_warnings():  # read-only bytes: the values are copied out at once
                warnings.simplefilter("ignore", UserWarning)
                for off, (_, _, size, out, first, dtype) in parts:
                    vals = torch.frombuffer(view[off : off + size], dtype=DTYPES[dtype])
                    out[first : first + vals.numel()].copy_(vals)

        if len(jobs) == 1:
            run(jobs[0])
            return
        with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            list(pool.map(run, jobs))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_files(storage: Storage) -> list[str]:
    """Names of the files directly in a model directory."""
    import pyarrow.fs as pafs

    infos = storage.fs.get_file_info(pafs.FileSelector(storage.base, allow_not_found=True))
    return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.File)


def pretrained_weights(cfg, storage_cfg=None):
    """The weights in `model.path` that the model starts from, or None (`model.init=random`,
    no path, or an HF directory without weights under `init=auto`). ModelError when
    `model.init=pretrained` finds none, or the path cannot be read."""
    if not cfg.path or cfg.init == "random":
        return None
    try:
        weights = SafetensorsWeights.find(cfg.path, storage_cfg)
    except StorageError as e:
        raise ModelUnavailable(f"model.path: cannot read {cfg.path}: {e}") from None
    if weights is None and (cfg.init == "pretrained" or cfg.kind != "hf"):
        raise ModelError(f"model.path: no weights in {cfg.path} (expected {SINGLE}, or {INDEX} and the files it "
                         f"lists)" + ("; set model.init=random to train it from scratch" if cfg.kind == "hf" else ""))
    return weights


def weights_record(weights, path: str) -> dict:
    """The part of `ModelSpec.record()` that says where the initial weights came from."""
    if weights is None:
        return {"source": path or None, "init": "random"}
    return {"source": path, "init": "pretrained", "weights_sha256": weights.fingerprint,
            "weights_dtype": weights.dtype()}
