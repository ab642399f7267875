"""Token shards in Parquet: preparing them from text and reading windows back.

A dataset is a folder (local path or any URI `pyarrow.fs` understands) holding
``shard-NNNNN.parquet`` files, each one column ``tokens`` (uint16, or uint32 for a vocabulary
above 65,536 ids) split into row groups, and a ``meta.json`` written last: a folder without it
is not a dataset (an interrupted prepare). Each document is followed by the tokenizer's
end-of-sequence id (and starts with its BOS where it adds one): see tokenizer.py; the default
tokenizer is bytes, end-of-text 256. meta.json records the tokenizer (its hash, vocabulary
size and special tokens) so that training can check the dataset against the model.

Instruction examples (`instructions`) and preference pairs (`preferences`, two examples each) add
a `mask` column: 1 on the tokens the model learns to produce.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import sys
import threading
import uuid
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayzero.data.errors import DataError
from rayzero.storage import StorageError, explained, require_bucket, settings_of
from rayzero.data.sources import Fields, each_document, list_sources
from rayzero.data.tokenizer import BYTE_EOT, BYTE_VOCAB, ByteTokenizer, Tokenizer, load_tokenizer, token_dtype

EOT = BYTE_EOT
VOCAB_SIZE = BYTE_VOCAB
log = logging.getLogger(__name__)
FORMAT = "rayzero-tokens"
FORMAT_VERSION = 2  # 1: bytes only, uint16, no tokenizer record (still read)
DOCUMENTS = "documents.parquet"  # each document's (example's) length in tokens, in order
TOKENIZER_DIR = "tokenizer"  # the tokenizer the dataset was made with, as save_pretrained writes it
ENCODE_BATCH = 256  # documents per call into the tokenizer
MASKED_KINDS = ("instructions", "preferences")  # kinds of dataset with a `mask` column


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode(tokens: Iterable[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def _filesystem(uri: str, storage_cfg=None) -> tuple[pafs.FileSystem, str]:
    """Local paths, file:// and s3:// (with the checkpoint.s3_* settings or the AWS variables)."""
    from rayzero.data.sources import _split

    fs, path, _ = _split(uri, storage_cfg)
    return fs, path


class ShardWriter:
    """Token arrays in, Parquet shards of about `shard_tokens` out; meta.json last.

    A prepare that fails leaves nothing behind (`discard`). On a local disk the shards go to a
    hidden folder beside `out`, renamed to `out` at the commit (a dataset already there is
    replaced only then); in object storage, which has no rename, into `out` itself, meta.json
    last, and a failure deletes what it wrote (with a dataset already there: deletes it, whose
    meta.json went first, so that it is never half old and half new)."""

    def __init__(self, out: str, dtype: np.dtype, shard_tokens: int, row_group_tokens: int, storage_cfg=None,
                 with_mask: bool = False):
        self.fs, self.final = _filesystem(out, storage_cfg)
        require_bucket(self.fs, self.final, out, create=settings_of(storage_cfg).create_bucket)
        self.staged = isinstance(self.fs, pafs.LocalFileSystem)
        if self.staged:
            parent, name = posixpath.split(self.final.rstrip("/"))
            self.root = posixpath.join(parent, f".{name}.preparing-{uuid.uuid4().hex[:8]}")
        else:
            self.root = self.final
            self.existed = self.fs.get_file_info(self.final).type != pafs.FileType.NotFound
        self.fs.create_dir(self.root, recursive=True)
        meta = posixpath.join(self.root, "meta.json")
        if self.fs.get_file_info(meta).type == pafs.FileType.File:
            self.fs.delete_file(meta)  # from now on the folder is not a dataset until we commit
        self.dtype, self.shard_tokens, self.row_group_tokens = dtype, shard_tokens, row_group_tokens
        self.arrow_type = pa.uint16() if dtype == np.uint16 else pa.uint32()
        self.shards: list[dict] = []
        self.pending: list[np.ndarray] = []
        self.masks: list[np.ndarray] | None = [] if with_mask else None
        self.lengths: list[int] = []
        self.prompts: list[int] = []  # with a mask: each example's tokens before its first masked-in one
        self.target_tokens = 0
        self.pending_len = 0
        self.digest = hashlib.sha256()
        self.documents = 0

    def add(self, doc: np.ndarray, mask: np.ndarray | None = None) -> None:
        doc = doc.astype(self.dtype, copy=False)
        self.digest.update(doc.tobytes())
        self.pending.append(doc)
        self.lengths.append(int(doc.size))
        if self.masks is not None:
            mask = mask.astype(np.uint8, copy=False)
            self.digest.update(mask.tobytes())
            self.masks.append(mask)
            self.target_tokens += int(mask.sum())
            self.prompts.append(int(np.argmax(mask)) if mask.any() else int(mask.size))
        self.pending_len += doc.size
        self.documents += 1
        if self.pending_len >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        tokens = np.concatenate(self.pending) if self.pending else np.zeros(0, self.dtype)
        name = f"shard-{len(self.shards):05d}.parquet"
        columns = {"tokens": pa.array(tokens, type=self.arrow_type)}
        if self.masks is not None:
            columns["mask"] = pa.array(np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8))
            self.masks = []
        table = pa.table(columns)
        with self.fs.open_output_stream(posixpath.join(self.root, name)) as f:
            pq.write_table(table, f, row_group_size=self.row_group_tokens, compression="zstd")
        self.shards.append({"file": name, "num_tokens": int(tokens.size)})
        self.pending, self.pending_len = [], 0

    def commit(self, meta: dict, files: dict[str, bytes] | None = None) -> dict:
        """Flush what is left, write `files` (relative names), then meta.json: the commit."""
        if self.pending:
            self.flush()
        for name, data in (files or {}).items():
            self.fs.create_dir(posixpath.dirname(posixpath.join(self.root, name)), recursive=True)
            with self.fs.open_output_stream(posixpath.join(self.root, name)) as f:
                f.write(data)
        with self.fs.open_output_stream(posixpath.join(self.root, DOCUMENTS)) as f:  # where each one ends
            columns = {"length": pa.array(self.lengths, type=pa.int64())}
            if self.masks is not None:
                columns["prompt"] = pa.array(self.prompts, type=pa.int64())
            pq.write_table(pa.table(columns), f, compression="zstd")
        meta = {"format": FORMAT, "version": FORMAT_VERSION, **meta, "dtype": self.dtype.name,
                "num_tokens": sum(s["num_tokens"] for s in self.shards), "num_documents": self.documents,
                "shards": self.shards, "fingerprint": self.digest.hexdigest()[:16]}
        with self.fs.open_output_stream(posixpath.join(self.root, "meta.json")) as f:  # the commit
            f.write(json.dumps(meta, indent=2).encode())
        if self.staged:  # the whole dataset appears at `out` at once
            old = None
            if self.fs.get_file_info(self.final).type != pafs.FileType.NotFound:
                old = f"{self.root}.old"
                self.fs.move(self.final, old)
            self.fs.move(self.root, self.final)
            if old is not None:
                self.fs.delete_dir(old)
            self.root = self.final
        return meta

    def discard(self) -> None:
        """After a failure: what this writer wrote goes (see the class)."""
        try:
            if self.staged or not self.existed:
                self.fs.delete_dir(self.root)
            else:
                self.fs.delete_dir_contents(self.root)
        except OSError as e:  # the failure itself is what the user must see
            log.warning("could not remove %s after the failed prepare: %s", self.root, e)


def prepare(
    src: str | Path,
    out: str,
    pattern: str = "*",
    shard_tokens: int = 1 << 24,
    row_group_tokens: int = 1 << 16,
    exclude: tuple[str, ...] = (),
    *,
    tokenizer: str | Tokenizer | None = "byte",
    fields: Fields = Fields(),
    strict_utf8: bool = False,
    progress: bool = False,
    storage_cfg=None,
    instructions: bool = False,
    preferences: bool = False,
    prompts: bool = False,
    tokenize_with: Callable | None = None,
) -> dict:
    """Tokenize the documents under `src` (see sources.py) into shards at `out`; with
    `instructions`, JSON records of prompt/response or messages (see examples.py); with
    `preferences`, records of prompt/chosen/rejected, two examples each (see pairs.py); with
    `prompts`, prompt-only records for online RL, their other fields kept (see prompts.py).
    `tokenize_with(src, writer, tok, ...)`: fills the writer in place of this process, in the
    same order, and returns what it skipped (Ray Data: `rayzero.jobs.ray_prepare`).

    What is not UTF-8 is skipped and named (refused with `strict_utf8`), and so are files below a
    directory named in `exclude`. Returns the written metadata.
    """
    if instructions + preferences + prompts > 1:
        raise DataError("instructions, preferences or prompts: a dataset holds one kind of record")
    kind = "instructions" if instructions else "preferences" if preferences else "prompts" if prompts else "text"
    tok = load_tokenizer(tokenizer)
    try:  # storage refusing (credentials, a bucket): one message naming what, not a traceback
        files = list_sources(str(src), pattern, exclude, storage_cfg)
        writer = ShardWriter(out, token_dtype(tok.vocab_size), shard_tokens, row_group_tokens, storage_cfg,
                             with_mask=kind in MASKED_KINDS)
    except (OSError, StorageError) as e:
        raise DataError(_storage_words(e)) from None
    try:
        return _fill(writer, src, tok, files, kind, pattern, exclude, fields, strict_utf8, progress, storage_cfg,
                     instructions, preferences, tokenize_with, prompts)
    except OSError as e:
        writer.discard()
        raise DataError(_storage_words(e)) from None
    except BaseException:
        writer.discard()
        raise


def _storage_words(e: BaseException) -> str:
    """A storage error in a prepare's words: `storage.explained`, or a StorageError's own."""
    return str(e) if isinstance(e, StorageError) else explained(e)


def _fill(writer: ShardWriter, src, tok: Tokenizer, files, kind: str, pattern, exclude, fields, strict_utf8,
          progress, storage_cfg, instructions, preferences, tokenize_with, prompts=False) -> dict:
    """`prepare`'s work, into `writer`, to its commit: the written metadata."""
    skipped: list[str] | None = None if strict_utf8 else []
    bar = _progress(files, progress)
    if tokenize_with is not None:
        skipped = tokenize_with(str(src), writer, tok, pattern=pattern, exclude=exclude, fields=fields,
                                strict_utf8=strict_utf8, instructions=instructions, preferences=preferences,
                                storage_cfg=storage_cfg,
                                bar=bar, batch_docs=ENCODE_BATCH)
        for where in skipped:
            log.warning("skipped %s: not UTF-8", where)
    elif instructions:
        from rayzero.data.examples import add_examples

        add_examples(files, tok, writer, skipped, bar)
    elif preferences:
        from rayzero.data.pairs import add_pairs

        add_pairs(files, tok, writer, skipped, bar)
    elif prompts:
        from rayzero.data.prompts import add_prompts

        columns = add_prompts(files, tok, writer, skipped, bar)
    else:
        _add_documents(files, tok, writer, fields, skipped, bar)
    bar.close()
    if not writer.documents:
        what = {"instructions": "instruction records", "preferences": "preference records",
                "prompts": "prompt records"}.get(kind, "UTF-8 documents")
        raise DataError(f"no {what} in {src}" + (f" (matching {pattern!r})" if pattern != "*" else ""))
    # The tokenizer itself beside the tokens: generate and exports find it without the model directory.
    saved = {f"{TOKENIZER_DIR}/{name}": data for name, data in tok.saved_files().items()}
    record = {**tok.record(), **({"dir": TOKENIZER_DIR} if saved else {})}
    meta = {"kind": kind, "vocab_size": tok.vocab_size, "eot": tok.eos_id,
            "tokenizer": record, "source": str(src), "skipped": (skipped or [])[:100],
            "num_skipped": len(skipped or [])}
    if preferences:
        meta["num_pairs"] = writer.documents // 2
    if prompts:
        from rayzero.data.prompts import COLUMNS

        meta["num_prompts"] = writer.documents
        meta["conversational"] = bool(columns.first and columns.first[0])
        meta["columns"] = sorted({k for row in columns.rows for k in row} - {"prompt"})
        saved[COLUMNS] = columns.parquet()
    if kind in MASKED_KINDS:
        meta["num_target_tokens"] = writer.target_tokens
    return writer.commit(meta, saved)


def _add_documents(files, tok, writer: ShardWriter, fields: Fields, skipped, bar) -> None:
    batch: list[str] = []

    def encode_batch():
        for doc in tok.documents(batch, writer.dtype):
            writer.add(doc)
        batch.clear()

    for text in each_document(files, fields, skipped, on_file=lambda f: bar.update(f.size)):
        batch.append(text)
        if len(batch) >= ENCODE_BATCH:
            encode_batch()
    encode_batch()


def _progress(files, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True, desc="tokenizing",
                disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def read_meta(uri: str, storage_cfg=None, tokenizer: str | None = None, kind: str = "") -> dict:
    """The dataset's meta.json (a v1 dataset's in today's terms: bytes, uint16). `tokenizer`:
    the model directory whose tokenizer a missing dataset must be made with, `kind`
    ("preferences", "instructions"; "": documents) the records it must hold (the hint says so)."""
    fs, root = _filesystem(uri, storage_cfg)
    path = posixpath.join(root, "meta.json")
    try:
        found = fs.get_file_info(path).type
    except OSError as e:
        raise DataError(f"cannot read the dataset at {uri}: {_storage_words(e)}") from None
    if found != pafs.FileType.File:
        flag = f" --{kind}" if kind else ""
        how = f"{flag} --tokenizer {tokenizer}`, the model's own tokenizer" if tokenizer else f"{flag}`"
        raise DataError(f"no dataset at {uri}: expected {path} (make one with `rayzero data prepare SRC {uri}{how})")
    with fs.open_input_stream(path) as f:
        meta = json.loads(f.read())
    if meta.get("format") != FORMAT or meta.get("version") not in (1, FORMAT_VERSION):
        raise DataError(f"{path} is not a {FORMAT} dataset of version 1 or {FORMAT_VERSION}")
    if meta["version"] == 1:
        meta = {**meta, "dtype": "uint16", "tokenizer": ByteTokenizer().record()}
    return meta


def dataset_tokenizer_files(uri: str, storage_cfg=None) -> dict[str, bytes]:
    """The files of the tokenizer copy a dataset keeps (empty: bytes, or a dataset prepared by
    an older rayzero, which keeps none)."""
    record = read_meta(uri, storage_cfg)["tokenizer"]
    if "dir" not in record:
        return {}
    fs, root = _filesystem(uri, storage_cfg)
    files = {}
    for info in fs.get_file_info(pafs.FileSelector(posixpath.join(root, record["dir"]))):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                files[info.base_name] = f.read()
    return files


def dataset_tokenizer(uri: str, storage_cfg=None) -> Tokenizer | None:
    """The tokenizer a dataset was made with, loaded from the copy it keeps; None where it
    keeps none."""
    record = read_meta(uri, storage_cfg)["tokenizer"]
    if record["kind"] == "byte":
        return ByteTokenizer()
    files = dataset_tokenizer_files(uri, storage_cfg)
    if not files:
        return None
    from rayzero.data.tokenizer import tokenizer_from_files

    return tokenizer_from_files(files, record.get("name") or "tokenizer")


@dataclass(frozen=True)
class _RowGroup:
    shard: int
    index: int
    start: int  # global token offset
    end: int


def numbers(column: pa.ChunkedArray, where: str = "") -> np.ndarray:
    """A column of integers without nulls as one read-only numpy array, viewed from its Arrow
    buffers (one chunk: no copy). What `column.to_numpy()` gives, without its first call's
    import of pandas: 0.23 s in a rank process, on the first step of every rank, spare and
    restart (measured). `where`: what the column is, for the error if it is not one."""
    arrays = []
    for chunk in column.chunks:
        if chunk.null_count or not pa.types.is_integer(chunk.type):
            raise DataError(f"{where or 'a column'}: expected integers without nulls, got {chunk.type} with "
                            f"{chunk.null_count} nulls")
        dtype = np.dtype(str(chunk.type))
        arrays.append(np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize))
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else np.zeros(0, np.dtype(str(column.type)))


class TokenDataset:
    """Random access to token windows; reads (and caches) only the row groups a window touches."""

    def __init__(self, uri: str, cache_row_groups: int = 1024, storage_cfg=None):
        self.uri = uri
        self.meta = read_meta(uri, storage_cfg)
        self.num_tokens = int(self.meta["num_tokens"])
        self.fingerprint = self.meta["fingerprint"]
        self._fs, self._root = _filesystem(uri, storage_cfg)
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

    @property
    def kind(self) -> str:
        """`text` (documents), `instructions` (examples with a loss mask) or `preferences` (pairs
        of examples with a loss mask: prompt + chosen, prompt + rejected)."""
        return self.meta.get("kind", "text")

    @property
    def masked(self) -> bool:
        """Whether the tokens have a loss mask beside them (instruction examples, preference pairs)."""
        return self.kind in MASKED_KINDS

    @cached_property
    def prompt_lengths(self) -> np.ndarray:
        """Each example's tokens before its first masked-in one, in order (a preference pair's
        prompt), from documents.parquet."""
        path = posixpath.join(self._root, DOCUMENTS)
        table = None
        if self.masked and self._fs.get_file_info(path).type == pafs.FileType.File:
            with self._fs.open_input_file(path) as f:
                table = pq.read_table(f)
        if table is None or "prompt" not in table.column_names:
            raise DataError(f"{self.uri}: {DOCUMENTS} records no prompt lengths (a {self.kind} dataset prepared by an "
                            "older rayzero); prepare it again")
        return numbers(table.column("prompt"), f"{self.uri}: {DOCUMENTS} prompt").astype(np.int64)

    @cached_property
    def document_lengths(self) -> np.ndarray:
        """Each document's (instruction example's) length in tokens, in order: from
        documents.parquet, or for a dataset older than it from where the end-of-text ids are."""
        path = posixpath.join(self._root, DOCUMENTS)
        if self._fs.get_file_info(path).type == pafs.FileType.File:
            with self._fs.open_input_file(path) as f:
                lengths = numbers(pq.read_table(f).column("length"), f"{self.uri}: {DOCUMENTS} length").astype(np.int64)
        else:
            eot = self.meta["eot"]
            ends = np.concatenate([np.flatnonzero(self._read_group_uncached(i) == eot) + g.start
                                   for i, g in enumerate(self._groups)] or [np.zeros(0, np.int64)])
            lengths = np.diff(np.concatenate([[0], ends + 1]))
            if ends.size == 0 or ends[-1] + 1 != self.num_tokens:  # text after the last end-of-text
                lengths = np.append(lengths, self.num_tokens - (ends[-1] + 1 if ends.size else 0))
        if int(lengths.sum()) != self.num_tokens:
            raise DataError(f"{self.uri}: {DOCUMENTS} covers {int(lengths.sum())} tokens, meta.json says "
                            f"{self.num_tokens}")
        return lengths

    def _read_group_uncached(self, i: int) -> np.ndarray:
        g = self._groups[i]
        columns = ["tokens", "mask"] if self.masked else ["tokens"]
        with self._lock:  # a ParquetFile is not safe to read from two threads at once
            table = self._files[g.shard].read_row_group(g.index, columns=columns)
        where = f"{self.uri}: row group {g.index} of {self.meta['shards'][g.shard]['file']}"
        if len(columns) == 1:
            return numbers(table.column(0), f"{where}, tokens")
        return np.stack([numbers(table.column(0), f"{where}, tokens").astype(np.int64),
                         numbers(table.column(1), f"{where}, mask").astype(np.int64)])

    def _gather(self, start: int, length: int, rows: int) -> np.ndarray:
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside {self.num_tokens} tokens")
        out = np.empty((rows, length), dtype=np.int64)
        pos = start
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while pos < start + length:
            g = self._groups[i]
            take = min(g.end, start + length) - pos
            group = self._read_group(i)
            out[:, pos - start : pos - start + take] = group[..., pos - g.start : pos - g.start + take]
            pos += take
            i += 1
        return out

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the concatenated corpus."""
        if self.masked:
            return self._gather(start, length, 2)[0]
        return self._gather(start, length, 1)[0]

    def window_with_mask(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, start + length)`` and their loss mask (all ones for text)."""
        if not self.masked:
            return self.window(start, length), np.ones(length, np.int64)
        both = self._gather(start, length, 2)
        return both[0], both[1]
