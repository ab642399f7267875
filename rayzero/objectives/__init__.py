"""What a run optimises, behind one seam (`base.py`): next-token prediction (`next_token.py`),
preference tuning (`dpo.py`), or an `Objective` of a user's own. The built-in ones are
registered by name in `config.py`, which the config reads without torch."""

from rayzero.objectives.config import OBJECTIVES, DPOConfig

__all__ = ["OBJECTIVES", "DPOConfig", "Objective", "Metric", "Output"]


def __getattr__(name: str):
    """`Objective`, `Metric`, `Output`: imported (with torch) when first asked for."""
    if name in ("Objective", "Metric", "Output"):
        from rayzero.objectives import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
