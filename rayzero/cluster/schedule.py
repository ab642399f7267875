"""The learning-rate schedule, computed by the controller and sent to ranks with each plan."""

import math

from rayzero.sharding.config import OptimConfig


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay from `lr` to `min_lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
