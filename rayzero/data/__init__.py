"""Token datasets: preparing them (tokens.py, from sources.py through tokenizer.py), and what
each rank reads of them (batches.py, instruct.py, preferences.py, validation.py). Names are
imported on first use, so that preparing data (in Ray Data's workers too) does not import torch."""

_NAMES = {
    "RankBatches": "rayzero.data.batches", "global_batch_offsets": "rayzero.data.batches",
    "DataConfig": "rayzero.data.config", "DataError": "rayzero.data.errors",
    "TokenDataset": "rayzero.data.tokens", "prepare": "rayzero.data.tokens", "read_meta": "rayzero.data.tokens",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'rayzero.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_NAMES[name]), name)
