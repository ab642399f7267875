"""The learning-rate schedule, computed by the controller and sent to ranks with each plan."""

import math

from rayzero.sharding.config import OptimConfig


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warmup reaching `lr` at step ``warmup_steps - 1``, then cosine decay that reaches
    the final learning rate (`min_lr`) exactly at the last step, ``total_steps - 1``."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * (step + 1) / w
    peak = max(w - 1, 0)
    progress = min(1.0, (step - peak) / max(1, total_steps - 1 - peak))
    return cfg.final_lr + 0.5 * (cfg.lr - cfg.final_lr) * (1 + math.cos(math.pi * progress))
