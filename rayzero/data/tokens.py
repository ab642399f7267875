"""Byte-level token shards in Parquet: preparing them from text and reading windows back.

A dataset is a folder (local path or any URI `pyarrow.fs` understands) holding
``shard-NNNNN.parquet`` files, each one uint16 column ``tokens`` split into row groups, and a
``meta.json`` written last: a folder without it is not a dataset (an interrupted prepare).
Documents are separated by the end-of-text token 256, after their 256 byte values.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

EOT = 256
VOCAB_SIZE = 257
FORMAT = "rayzero-tokens"
FORMAT_VERSION = 1


class DataError(ValueError):
    """A dataset that is missing, malformed, or too small for the job."""


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(tokens: Iterable[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        uri = str(Path(uri).expanduser().resolve())
        return pafs.LocalFileSystem(), uri
    return pafs.FileSystem.from_uri(uri)


def _source_files(src: Path, pattern: str, exclude: tuple[str, ...]) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise DataError(f"data source {src} does not exist")
    return sorted(
        p for p in src.rglob(pattern)
        if p.is_file() and not exclude_hit(p.relative_to(src).parts, exclude)
    )


def exclude_hit(parts: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    return any(part in exclude for part in parts[:-1])


def prepare(
    src: str | Path,
    out: str,
    pattern: str = "*",
    shard_tokens: int = 1 << 24,
    row_group_tokens: int = 1 << 16,
    exclude: tuple[str, ...] = (),
) -> dict:
    """Tokenize every UTF-8 text file under `src` (matching `pattern`) into shards at `out`.

    Files that are not valid UTF-8 are skipped, and so are files below a directory named
    in `exclude`. Returns the written metadata.
    """
    files = _source_files(Path(src).expanduser(), pattern, exclude)
    fs, root = _filesystem(out)
    fs.create_dir(root, recursive=True)
    shards, pending, pending_len, used = [], [], 0, 0
    digest = hashlib.sha256()

    def flush():
        nonlocal pending, pending_len
        tokens = np.concatenate(pending) if pending else np.zeros(0, np.uint16)
        name = f"shard-{len(shards):05d}.parquet"
        table = pa.table({"tokens": pa.array(tokens, type=pa.uint16())})
        with fs.open_output_stream(posixpath.join(root, name)) as f:
            pq.write_table(table, f, row_group_size=row_group_tokens, compression="zstd")
        shards.append({"file": name, "num_tokens": int(tokens.size)})
        pending, pending_len = [], 0

    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        doc = np.append(encode(text), np.uint16(EOT))
        digest.update(doc.tobytes())
        pending.append(doc)
        pending_len += doc.size
        used += 1
        if pending_len >= shard_tokens:
            flush()
    if pending:
        flush()
    if not shards:
        raise DataError(f"no UTF-8 text files matching {pattern!r} under {src}")
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "vocab_size": VOCAB_SIZE,
        "eot": EOT,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": used,
        "shards": shards,
        "fingerprint": digest.hexdigest()[:16],
        "source": str(src),
    }
    with fs.open_output_stream(posixpath.join(root, "meta.json")) as f:  # the commit
        f.write(json.dumps(meta, indent=2).encode())
    return meta


def read_meta(uri: str) -> dict:
    fs, root = _filesystem(uri)
    path = posixpath.join(root, "meta.json")
    if fs.get_file_info(path).type != pafs.FileType.File:
        raise DataError(
            f"no dataset at {uri}: expected {path} (make one with `rayzero data prepare SRC {uri}`)"
        )
    meta = json.loads(fs.open_input_stream(path).read())
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} dataset")
    return meta


@dataclass(frozen=True)
class _RowGroup:
    shard: int
    index: int
    start: int  # global token offset
    end: int


class TokenDataset:
    """Random access to token windows; reads (and caches) only the row groups a window touches."""

    def __init__(self, uri: str, cache_row_groups: int = 1024):
        self.uri = uri
        self.meta = read_meta(uri)
        self.num_tokens = int(self.meta["num_tokens"])
        self.fingerprint = self.meta["fingerprint"]
        self._fs, self._root = _filesystem(uri)
        self._files = [pq.ParquetFile(self._open(s["file"])) for s in self.meta["shards"]]
        groups, offset = [], 0
        for si, f in enumerate(self._files):
            for gi in range(f.num_row_groups):
                n = f.metadata.row_group(gi).num_rows
                groups.append(_RowGroup(si, gi, offset, offset + n))
                offset += n
        if offset != self.num_tokens:
            raise DataError(f"{uri}: shards hold {offset} tokens, meta.json says {self.num_tokens}")
        self._groups = groups
        self._starts = np.array([g.start for g in groups], dtype=np.int64)
        self._lock = threading.Lock()
        self._read_group = lru_cache(maxsize=cache_row_groups)(self._read_group_uncached)

    def _open(self, name: str):
        return self._fs.open_input_file(posixpath.join(self._root, name))

    def _read_group_uncached(self, i: int) -> np.ndarray:
        g = self._groups[i]
        with self._lock:  # a ParquetFile is not safe to read from two threads at once
            col = self._files[g.shard].read_row_group(g.index, columns=["tokens"]).column(0)
        return col.to_numpy()

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the concatenated corpus."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        pos = start
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while pos < start + length:
            g = self._groups[i]
            take = min(g.end, start + length) - pos
            out[pos - start : pos - start + take] = self._read_group(i)[pos - g.start : pos - g.start + take]
            pos += take
            i += 1
        return out
