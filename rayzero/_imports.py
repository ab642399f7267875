"""`package.module:name` to the object it names: what `model.factory`, `train.objective` and a
reward function's path share. Imports nothing of rayzero's."""

from __future__ import annotations

import importlib


def import_path(path: str, key: str, form: str = "package.module:name"):
    """The object `path` names; ValueError in one line, `key` (the setting) first, saying what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}: {path!r} is not of the form {form}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or the module failing as it runs
        raise ValueError(f"{key}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
