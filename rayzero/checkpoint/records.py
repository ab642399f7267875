"""Records a checkpoint keeps of how it was made (the model's `ModelSpec.record()`, the
objective's), as a resume compares them: in the form the manifest stores them, so that what a
run writes and what the same command computes again compare equal (a tuple comes back from
JSON as a list: compared in memory, `("q_proj",) != ["q_proj"]` refused a run's own
checkpoint). Pure Python, no torch: the config checks import it."""

from __future__ import annotations

import json

_MISSING = object()


def stored(record):
    """`record` as a manifest stores it and a resume reads it back (JSON: tuples become lists,
    keys strings)."""
    return json.loads(json.dumps(record))


def first_difference(was, now, path: str = "") -> tuple[str, object, object] | None:
    """Where two records (compared as stored) first differ: (the dotted path to the field, its
    value in `was`, its value in `now`), keys in sorted order; None where they are the same.
    A key one side lacks differs with the value `missing`."""
    return _first(stored(was), stored(now), path)


def _first(was, now, path: str):
    if isinstance(was, dict) and isinstance(now, dict):
        for key in sorted(set(was) | set(now)):
            found = _first(was.get(key, _MISSING), now.get(key, _MISSING), f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if was != now:
        return path or "(the record)", _said(was), _said(now)
    return None


def _said(value):
    return "missing" if value is _MISSING else value


def brief(value, limit: int = 60) -> str:
    """A value in a message, cut to `limit` characters."""
    text = "none" if value is None else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
