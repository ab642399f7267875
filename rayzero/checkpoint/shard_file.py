"""One rank's shard as a safetensors file, streamed to storage and read back by byte range.

The file is plain safetensors (an 8-byte header length, a JSON header, the raw tensors), so
`safetensors.torch.load_file` opens it; it is written here as a stream, hashing as it goes,
so a shard never exists twice in memory. The manifest records a SHA-256 per 4 MiB block: a
reader that fetches a byte range checks just the blocks it touches.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import torch

from rayzero.storage import Storage

BLOCK = 4 << 20
NAMES = ("main", "exp_avg", "exp_avg_sq")  # fp32, the same length, in the shard's local order


class ChecksumError(RuntimeError):
    """A shard whose bytes do not match the manifest; the message names the file."""


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    head, offset = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        head[name] = {"dtype": "F32", "shape": [t.numel()], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


class _BlockHasher:
    def __init__(self):
        self.hashes: list[str] = []
        self._h = hashlib.sha256()
        self._fill = 0
        self.size = 0

    def update(self, data: memoryview) -> None:
        self.size += len(data)
        while len(data):
            take = min(BLOCK - self._fill, len(data))
            self._h.update(data[:take])
            self._fill += take
            data = data[take:]
            if self._fill == BLOCK:
                self._close()

    def _close(self) -> None:
        self.hashes.append(self._h.hexdigest())
        self._h, self._fill = hashlib.sha256(), 0

    def finish(self) -> list[str]:
        if self._fill:
            self._close()
        return self.hashes


def write_shard(storage: Storage, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                on_block=None) -> dict:
    """Stream `tensors` (CPU, fp32, contiguous) to `key`; returns its size and block hashes.
    `on_block()`, if given, is called after each block is handed to the stream."""
    header = _header(tensors, metadata)
    hasher = _BlockHasher()
    with storage.output_stream(key) as f:
        for chunk in [memoryview(header)] + [memoryview(t.numpy()).cast("B") for t in tensors.values()]:
            for lo in range(0, len(chunk), BLOCK):
                piece = chunk[lo : lo + BLOCK]
                f.write(piece)
                hasher.update(piece)
                if on_block is not None:
                    on_block()
    return {"size": hasher.size, "block": BLOCK, "sha256": hasher.finish()}


class ShardReader:
    """Ranged, verified reads of one saved shard file."""

    def __init__(self, storage: Storage, key: str, entry: dict):
        self.storage, self.key, self.entry = storage, key, entry
        self._checked: set[int] = set()  # blocks already verified: hashed once, however read
        (n,) = struct.unpack("<Q", self._verified(0, 8))
        head = json.loads(self._verified(8, n))
        self.data_start = 8 + n
        self.offsets = {k: v["data_offsets"][0] for k, v in head.items() if k != "__metadata__"}
        self.metadata = head.get("__metadata__", {})

    def _verified(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length), read as whole blocks and checked against the manifest."""
        if length == 0:
            return b""
        block, hashes = self.entry["block"], self.entry["sha256"]
        first, last = offset // block, (offset + length - 1) // block
        start, end = first * block, min((last + 1) * block, self.entry["size"])
        if end > self.entry["size"] or last >= len(hashes):
            raise ChecksumError(f"{self.storage.uri}/{self.key}: bytes {offset}..{offset + length} "
                                f"lie beyond the recorded size {self.entry['size']}")
        data = self.storage.read_range(self.key, start, end - start)
        for i in range(first, last + 1):
            if i in self._checked:
                continue
            got = hashlib.sha256(data[(i - first) * block : (i - first + 1) * block]).hexdigest()
            if got != hashes[i]:
                raise ChecksumError(f"{self.storage.uri}/{self.key}: block {i} fails its checksum")
            self._checked.add(i)
        return data[offset - start : offset - start + length]

    def read_bytes(self, name: str, start: int, end: int) -> bytes:
        """The bytes of elements [start, end) of fp32 tensor `name`, verified."""
        base = self.data_start + self.offsets[name]
        return self._verified(base + 4 * start, 4 * (end - start))

    def read(self, name: str, start: int, end: int) -> np.ndarray:
        """Elements [start, end) of tensor `name` (fp32)."""
        return np.frombuffer(self.read_bytes(name, start, end), dtype=np.float32)


def verify(storage: Storage, key: str, entry: dict) -> None:
    """Read the whole file and check its size and every block; raises ChecksumError."""
    size = storage.size(key)
    if size != entry["size"]:
        raise ChecksumError(f"{storage.uri}/{key}: {size} bytes, the manifest says {entry['size']}")
    block = entry["block"]
    for i, expected in enumerate(entry["sha256"]):
        data = storage.read_range(key, i * block, min(block, size - i * block))
        if hashlib.sha256(data).hexdigest() != expected:
            raise ChecksumError(f"{storage.uri}/{key}: block {i} fails its checksum")
