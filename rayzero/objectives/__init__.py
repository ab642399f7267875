"""What a run trains for besides next-token prediction: preference tuning (`dpo.py`)."""

from rayzero.objectives.config import DPOConfig

__all__ = ["DPOConfig"]
