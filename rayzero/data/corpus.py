"""The default corpus: the Python standard library's own source, present on every machine."""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

from rayzero.data.tokens import prepare, read_meta


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus(cache_dir: str) -> Path:
    """Where the stdlib corpus is kept under `cache_dir` (prepared there or not yet)."""
    import sys

    return Path(cache_dir).expanduser() / f"pystdlib-{sys.version_info.major}.{sys.version_info.minor}"


def ensure_default_corpus(cache_dir: str) -> str:
    """Prepare the stdlib corpus under `cache_dir` on first use; return its path."""
    target = default_corpus(cache_dir)
    root = target.parent
    if (target / "meta.json").is_file():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".preparing-", dir=root))
    try:
        # The installed third-party packages live below the stdlib folder too; leave them out.
        prepare(stdlib_dir(), str(tmp), pattern="*.py", exclude=("site-packages", "dist-packages"))
        try:
            os.rename(tmp, target)  # atomic: a concurrent preparer may have won the race
        except OSError:
            read_meta(str(target))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
