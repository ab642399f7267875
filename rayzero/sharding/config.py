"""Configuration of the sharding strategy and of the optimizer it runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rayzero._frozen import Frozen

STRATEGIES = ("no_shard", "optim")


class ShardingConfig(Frozen):
    strategy: Literal["no_shard", "optim"] = "optim"
    bucket_numel: int = Field(default=2**22, ge=1)  # elements per bucket before padding (4M)
    shard_align: int = Field(default=64, ge=1)  # each rank's shard starts 64-element aligned
    overlap_grad_reduce: bool = True  # start each bucket's reduction as backward completes it
    overlap_param_gather: bool = True  # optim: forward waits per bucket for the parameter all-gather


class OptimConfig(Frozen):
    lr: float = Field(default=3e-3, gt=0)
    min_lr: float | None = Field(default=None, ge=0)  # None = lr / 10
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, ge=0)  # 0 disables clipping

    @property
    def final_lr(self) -> float:
        """Where the cosine decay ends."""
        return self.lr / 10 if self.min_lr is None else self.min_lr
