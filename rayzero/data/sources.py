"""What `rayzero data prepare` reads: files, folders and globs of text, JSON lines and Parquet,
local or in object storage (through `pyarrow.fs`).

    SRC                         a file, a folder (every file below it whose name matches
                                --glob), or a glob (`docs/*.txt`, `s3://bucket/corpus/**.jsonl`)
    .jsonl / .json              one JSON object per line (or a .json array of them); the
                                document is the `text_field` of each
    .parquet                    the `text_column` of each row
    anything else               the whole file is one document (UTF-8)

Files are taken in path order, records in file order: the dataset is a function of the
sources alone. A file that is not UTF-8 is named and skipped (or, strict, refused); a record
without its text field names the file and line.
"""

from __future__ import annotations

import fnmatch
import io
import json
import logging
import posixpath
from dataclasses import dataclass
from typing import Callable, Iterator

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayzero.data.errors import DataError
from rayzero.storage import StorageError, filesystem

log = logging.getLogger(__name__)
GLOB_CHARS = "*?["
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class SourceFile:
    fs: pafs.FileSystem
    path: str  # in `fs`
    uri: str  # as the user would name it
    size: int

    @property
    def format(self) -> str:
        name = self.path.lower()
        if name.endswith((".jsonl", ".json", ".ndjson")):
            return "json"
        if name.endswith((".parquet", ".pq")):
            return "parquet"
        return "text"


@dataclass(frozen=True)
class Fields:
    """Which field of a JSON record, or column of a Parquet row, holds a document's text."""

    text_field: str = "text"
    text_column: str = "text"


def _split(uri: str, storage_cfg=None) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path in it, the URI's prefix for naming files): `rayzero.storage.filesystem`,
    s3:// with the checkpoint.s3_* settings (or the AWS variables)."""
    try:
        fs, path = filesystem(uri, storage_cfg)
    except StorageError as e:
        raise DataError(f"{uri}: {e}") from None
    local = "://" not in uri or uri.startswith("file://")
    return fs, path, "" if local else uri[: uri.index("://") + 3]


def list_sources(src: str, pattern: str = "*", exclude: tuple[str, ...] = (), storage_cfg=None) -> list[SourceFile]:
    """The files SRC names, in path order."""
    fs, path, prefix = _split(str(src), storage_cfg)
    glob_at = min((path.find(c) for c in GLOB_CHARS if c in path), default=-1)
    if glob_at >= 0:
        base = path[: glob_at].rsplit("/", 1)[0] or "/"
        wanted = lambda rel, name: fnmatch.fnmatch(rel, path[len(base):].lstrip("/"))  # noqa: E731
    else:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            return [SourceFile(fs, path, prefix + path, info.size)]
        if info.type != pafs.FileType.Directory:
            raise DataError(f"data source {src} does not exist")
        base = path
        wanted = lambda rel, name: fnmatch.fnmatch(name, pattern)  # noqa: E731
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    files = []
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        rel = posixpath.relpath(info.path, base)
        parts = rel.split("/")
        if any(part in exclude for part in parts[:-1]):
            continue
        if wanted(rel, parts[-1]):
            files.append(SourceFile(fs, info.path, prefix + info.path, info.size))
    if not files:
        raise DataError(f"data source {src}: no files match" + ("" if glob_at >= 0 else f" {pattern!r}"))
    return sorted(files, key=lambda f: f.path.split("/"))  # as paths sort: part by part


class NotUTF8(DataError):
    pass


def _read_text(f: SourceFile) -> str:
    with f.fs.open_input_stream(f.path) as s:
        data = s.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotUTF8(f"{f.uri}: not UTF-8 (byte {e.start}); skip such files, or convert them") from None


def json_records(f: SourceFile, skipped: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """(where, record) of each JSON object in the file, streamed: `file:line`, or `file[index]`
    for a .json array. A line that is not UTF-8 is skipped and named in `skipped` (refused
    when `skipped` is None)."""
    if f.path.lower().endswith(".json") and _starts_with_bracket(f):
        text = _read_text(f)
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{f.uri}:{e.lineno}: not valid JSON ({e.msg})") from None
        for i, rec in enumerate(records):
            yield f"{f.uri}[{i}]", rec
        return
    with f.fs.open_input_stream(f.path) as s:
        for lineno, raw in enumerate(io.BufferedReader(s, 1 << 20), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                err = NotUTF8(f"{f.uri}:{lineno}: not UTF-8 (byte {e.start} of the line)")
                if skipped is None:
                    raise err from None
                log.warning("skipped %s", err)
                skipped.append(f"{f.uri}:{lineno}")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f.uri}:{lineno}: not valid JSON ({e.msg})") from None
            yield f"{f.uri}:{lineno}", rec


def _starts_with_bracket(f: SourceFile) -> bool:
    with f.fs.open_input_stream(f.path) as s:
        head = s.read(4096)
    return head.lstrip()[:1] == b"["


def field_of(rec, name: str, where: str, kind: str = "field") -> str:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a JSON object was expected, found {type(rec).__name__}")
    if name not in rec:
        have = ", ".join(sorted(rec)[:8]) or "none"
        hint = _record_hint(set(rec)) or "; name the text with --text-field"
        raise DataError(f"{where}: no {kind} {name!r} (it has: {have}){hint}")
    value = rec[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: {kind} {name!r} is {type(value).__name__}, not a string")
    return value


def _record_hint(keys: set[str]) -> str:
    """How to prepare records that hold other things than documents: preference pairs or
    instruction examples ("" when they look like neither)."""
    if {"chosen", "rejected"} & keys:
        return "; preference pairs? prepare them with --preferences"
    if {"prompt", "response", "messages"} & keys:
        return "; instruction records? prepare them with --instructions"
    return ""


def _parquet_file(f: SourceFile, handle) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(handle)
    except Exception as e:
        raise DataError(f"{f.uri}: not a Parquet file ({str(e).splitlines()[0]})") from None


def _parquet_texts(f: SourceFile, column: str, skipped: list[str] | None) -> Iterator[tuple[str, str]]:
    with f.fs.open_input_file(f.path) as handle:
        pf = _parquet_file(f, handle)
        names = pf.schema_arrow.names
        if column not in names:
            hint = _record_hint(set(names)) or "; name it with --text-column"
            raise DataError(f"{f.uri}: no column {column!r} (it has: {', '.join(names)}){hint}")
        row = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
            for value in batch.column(0).to_pylist():
                row += 1
                if value is None:
                    continue
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        if skipped is None:
                            raise NotUTF8(f"{f.uri}#{row}: not UTF-8") from None
                        log.warning("skipped %s#%d: not UTF-8", f.uri, row)
                        skipped.append(f"{f.uri}#{row}")
                        continue
                if not isinstance(value, str):
                    raise DataError(f"{f.uri}: column {column!r} holds {type(value).__name__}, not text")
                yield f"{f.uri}#{row}", value


def parquet_records(f: SourceFile, columns: tuple[str, ...], required: tuple[str, ...] = ()
                    ) -> Iterator[tuple[str, dict]]:
    """(where, record) of each row: `file#row`, a dict of those of `columns` the file has
    (a null value is left out, as a missing field); a file without one of `required` is refused."""
    with f.fs.open_input_file(f.path) as handle:
        pf = _parquet_file(f, handle)
        names = pf.schema_arrow.names
        missing = [c for c in required if c not in names]
        if missing:
            raise DataError(f"{f.uri}: no column {missing[0]!r} (it has: {', '.join(names)})")
        present = [c for c in columns if c in names]
        row = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=present):
            for values in zip(*(batch.column(c).to_pylist() for c in present)):
                row += 1
                yield f"{f.uri}#{row}", {c: v for c, v in zip(present, values) if v is not None}


def documents(f: SourceFile, fields: Fields = Fields(), skipped: list[str] | None = None) -> Iterator[str]:
    """The file's documents, in order. What is not UTF-8 raises NotUTF8 when `skipped` is
    None, else is skipped and named there: a whole text file, a JSON line, a Parquet value."""
    if f.format == "text":
        try:
            yield _read_text(f)
        except NotUTF8 as e:
            if skipped is None:
                raise
            log.warning("skipped %s", e)
            skipped.append(f.uri)
    elif f.format == "json":
        for where, rec in json_records(f, skipped):
            yield field_of(rec, fields.text_field, where)
    else:
        for _, text in _parquet_texts(f, fields.text_column, skipped):
            yield text


def each_document(files: list[SourceFile], fields: Fields, skipped: list[str] | None = None,
                  on_file: Callable[[SourceFile], None] | None = None) -> Iterator[str]:
    """Every document of every file, in order (see `documents`)."""
    for f in files:
        yield from documents(f, fields, skipped)
        if on_file is not None:
            on_file(f)
