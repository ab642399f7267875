"""Where every URI the project reads or writes goes: one rule from a URI to a `pyarrow.fs`
filesystem and a path in it (`filesystem`), and `Storage`, a root addressed by relative keys
with retries, for checkpoints and model directories.

A local path or file://... is the local filesystem; s3://bucket/key takes the `StorageSettings`
(`checkpoint.s3_*`), their empty fields falling back to the standard AWS variables; any other
scheme pyarrow knows (gs://, hdfs://, ...) is configured as pyarrow configures it. Credentials
are never part of a message: errors name the URI, never the keys.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageError(RuntimeError):
    """Storage that cannot be reached, written or read; the message names the URI."""


@dataclass(frozen=True)
class StorageSettings:
    """How to reach S3 (`checkpoint.s3_*`, `CheckpointConfig.storage`), and how often to retry
    a storage call. Empty fields fall back to the standard AWS variables, then AWS itself."""

    endpoint: str = ""  # host:port (https) or a URL such as http://127.0.0.1:8333
    region: str = ""
    access_key_id: str = ""
    secret_access_key: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    create_bucket: bool = False  # a bucket written to that does not exist: create it, else refuse
    retries: int = 5


def settings_of(given) -> StorageSettings:
    """`given` as StorageSettings: None = the defaults; a config holding them (the checkpoint
    config, which every caller already has): its `storage`."""
    if given is None:
        return StorageSettings()
    return given if isinstance(given, StorageSettings) else given.storage


def filesystem(uri: str, settings=None) -> tuple[pafs.FileSystem, str]:
    """The filesystem `uri` is on and its path there: a local path or file://... (resolved,
    `~` expanded); s3://bucket/key with `settings` (StorageSettings, or a config holding
    them); another scheme as pyarrow configures it. StorageError for a scheme pyarrow does not
    know. A local path or s3:// contacts nothing here."""
    if "://" not in uri or uri.startswith("file://"):
        return pafs.LocalFileSystem(), str(Path(uri.removeprefix("file://")).expanduser().resolve())
    if uri.startswith("s3://"):
        return _s3(settings_of(settings)), uri[len("s3://"):].rstrip("/")
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise StorageError(_clean(e)) from None


def destination(uri: str, settings=None, *, folder: bool = False) -> tuple[pafs.FileSystem, str]:
    """`filesystem(uri, settings)`, with the folder `uri` goes in (`folder`: `uri` itself)
    made where it is not there yet; an S3 bucket only with `checkpoint.s3_create_bucket`
    (else NoSuchBucket, naming it)."""
    fs, path = filesystem(uri, settings)
    require_bucket(fs, path, uri, create=settings_of(settings).create_bucket)
    fs.create_dir(path if folder else posixpath.dirname(path), recursive=True)
    return fs, path


class Storage:
    """One root (a checkpoint directory, a model directory): a filesystem and a base path,
    addressed by relative keys, each call retried. Local paths, file:// and s3:// only."""

    def __init__(self, uri: str, settings=None):
        if "://" in uri and not uri.startswith(("s3://", "file://")):
            raise StorageError(f"{uri}: unsupported scheme (use a local path, file:// or s3://)")
        self.uri = uri.rstrip("/")
        self.retries = settings_of(settings).retries
        self.create_bucket = settings_of(settings).create_bucket
        self.fs, self.base = filesystem(uri, settings)

    def path(self, key: str = "") -> str:
        return posixpath.join(self.base, key) if key else self.base

    def child(self, key: str) -> "Storage":
        other = object.__new__(Storage)
        other.fs, other.retries, other.create_bucket = self.fs, self.retries, self.create_bucket
        other.uri, other.base = f"{self.uri}/{key}", self.path(key)
        return other

    # -- retried primitives ------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except (OSError, pa.ArrowException) as e:
                if attempt == self.retries or permanent(e):
                    raise StorageError(f"{what} {self.uri}: {explained(e)}") from None
                log.warning("%s %s failed (%s); retrying in %.1fs", what, self.uri, _clean(e), delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def _make_parent(self, key: str) -> None:
        if isinstance(self.fs, pafs.LocalFileSystem):  # object stores have no folders to make
            self.fs.create_dir(posixpath.dirname(self.path(key)), recursive=True)

    def write_bytes(self, key: str, data: bytes) -> None:
        def write():
            self._make_parent(key)
            with self.fs.open_output_stream(self.path(key)) as f:
                f.write(data)

        self._retry(f"writing {key} to", write)

    def read_bytes(self, key: str) -> bytes:
        def read():
            with self.fs.open_input_stream(self.path(key)) as f:
                return f.read()

        return self._retry(f"reading {key} from", read)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset`: a ranged read, the rest of the file is not fetched."""
        def read():
            with self.fs.open_input_file(self.path(key)) as f:
                data = f.read_at(length, offset)
            if len(data) != length:
                raise OSError(f"short read of {key}: {len(data)} of {length} bytes at {offset}")
            return data

        return self._retry(f"reading {key} from", read)

    @contextmanager
    def output_stream(self, key: str) -> Iterator:
        self._retry("creating", lambda: self._make_parent(key))
        with self.fs.open_output_stream(self.path(key)) as f:
            yield f

    def size(self, key: str) -> int | None:
        info = self._retry("inspecting", lambda: self.fs.get_file_info(self.path(key)))
        return info.size if info.type == pafs.FileType.File else None

    def list_dirs(self) -> list[str]:
        """Names of the folders (prefixes) directly under the root (StorageError for a bucket
        that does not exist: not an empty listing)."""
        sel = pafs.FileSelector(self.base, allow_not_found=True)
        infos = self._retry("listing", lambda: self.fs.get_file_info(sel))
        if not infos:
            self._retry("listing", lambda: require_bucket(self.fs, self.base, self.uri))
        return sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.Directory)

    def delete_dir(self, key: str) -> None:
        self._retry("deleting", lambda: self.fs.delete_dir(self.path(key)))

    def probe(self) -> None:
        """Write, read back and delete a small object: raises StorageError with the cause
        (unreachable endpoint, wrong credentials, no such bucket, read-only path)."""
        key = ".rayzero-probe"
        self._retry("checking", lambda: require_bucket(self.fs, self.base, self.uri, create=self.create_bucket))
        try:
            self.write_bytes(key, b"ok")
            if self.read_bytes(key) != b"ok":
                raise StorageError(f"{self.uri}: what was written did not read back")
            self.fs.delete_file(self.path(key))
        except FileNotFoundError as e:
            raise StorageError(f"{self.uri}: {_clean(e)}") from None


def _s3(settings: StorageSettings) -> pafs.S3FileSystem:
    kw: dict = {}
    # pyarrow itself ignores the standard variable for S3-compatible stores (MinIO, SeaweedFS).
    endpoint = settings.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        scheme, sep, rest = endpoint.partition("://")
        kw["endpoint_override"] = rest if sep else endpoint
        kw["scheme"] = scheme if sep else "https"
    if settings.region:
        kw["region"] = settings.region
    if settings.access_key_id:
        kw["access_key"] = settings.access_key_id
        kw["secret_key"] = settings.secret_access_key
        if settings.session_token:
            kw["session_token"] = settings.session_token
    # Fail fast on a dead endpoint: the retries above are ours, with backoff.
    kw.update(connect_timeout=5, request_timeout=30, allow_bucket_creation=settings.create_bucket,
              retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2))
    return pafs.S3FileSystem(**kw)


class NoSuchBucket(StorageError):
    """An s3:// URI's bucket does not exist (and was not to be created)."""


def require_bucket(fs: pafs.FileSystem, path: str, uri: str, create: bool = False) -> None:
    """For S3: the bucket of `path` exists, or is created with `create`
    (`checkpoint.s3_create_bucket`); else NoSuchBucket naming it. Other filesystems: nothing."""
    if not isinstance(fs, pafs.S3FileSystem):
        return
    bucket = path.split("/", 1)[0]
    if fs.get_file_info(bucket).type != pafs.FileType.NotFound:
        return
    if create:
        fs.create_dir(bucket)
        return
    raise NoSuchBucket(f"{uri}: the bucket {bucket!r} does not exist; create it, or set "
                       f"checkpoint.s3_create_bucket=true for rayzero to create it")


def permanent(e: BaseException | str) -> bool:
    """Errors no retry can fix: wrong credentials, no permission, no such bucket, a malformed request."""
    text = str(e)
    return any(code in text for code in PERMANENT)


# What a storage error says when no retry can fix it.
PERMANENT = ("SIGNATURE_DOES_NOT_MATCH", "ACCESS_DENIED", "INVALID_ACCESS_KEY", "NO_SUCH_BUCKET",
             "does not exist; create it", "Permission denied", "Read-only file system", "Not a directory",
             "File exists", "AWS Error VALIDATION")  # the last: a malformed endpoint or bucket name


CREDENTIALS = ("ACCESS_DENIED", "SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY")


def explained(e: BaseException) -> str:
    """A storage error's first line (pyarrow names the bucket and key, never the credentials),
    and where the server refused the credentials, which settings give them."""
    text = _clean(e)
    if any(code in text for code in CREDENTIALS):
        text += " (the S3 credentials: checkpoint.s3_access_key_id and checkpoint.s3_secret_access_key, or the AWS_* variables)"
    return text


def _clean(e: BaseException) -> str:
    """The error's first line, which never holds credentials (pyarrow puts none in them)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
