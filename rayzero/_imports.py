"""`package.module:name` (or `path/to/file.py:name`) to the object it names: what
`model.factory`, `train.objective`, a reward function and a rollout engine share. Imports
nothing of rayzero's."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path

_LOADING = threading.RLock()  # a file's module is run once, whichever thread asks first


def import_path(path: str, key: str, form: str = "package.module:name"):
    """The object `path` names; ValueError in one line, `key` (the setting) first, saying what failed.
    A module given as a file (`….py`) is run from it, once a process."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}: {path!r} is not of the form {form}")
    try:
        module = _from_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except Exception as e:  # an ImportError, a missing file, or the module failing as it runs
        raise ValueError(f"{key}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _from_file(where: str):
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    name = f"rayzero_user_{path.stem}_{abs(hash(str(path))):x}"
    with _LOADING:  # not half-run: another thread would see the module before its names exist
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return sys.modules[name]
