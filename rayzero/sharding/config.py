"""Configuration of the sharding strategy, its precision policy, and the optimizer it runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rayzero._frozen import Frozen

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
Dtype = Literal["fp32", "bf16", "fp16"]


class ShardingConfig(Frozen):
    # no_shard = DDP, optim = ZeRO-1, optim_grads = ZeRO-2, optim_grads_params = ZeRO-3 / FSDP
    strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = "optim"
    bucket_numel: int = Field(default=2**22, ge=1)  # elements per bucket before padding (4M)
    shard_align: int = Field(default=64, ge=1)  # each rank's shard starts 64-element aligned
    overlap_grad_reduce: bool = True  # start each bucket's reduction as backward completes it
    overlap_param_gather: bool = True  # forward waits per bucket (per unit) for its all-gather
    # ZeRO-3: module classes that become FSDP units (outermost wins). The defaults fit the
    # built-in GPT: each block, the two embeddings, the final norm, the (tied) output head.
    fsdp_units: tuple[str, ...] = ("Block", "Embedding", "LayerNorm", "Linear")
    # Hybrid: replicas x shards. dp_outer > 1 shards within groups of world / dp_outer ranks;
    # outer_strategy no_shard all-reduces gradients across replicas (HSDP), optim also shards
    # the optimizer state across them (Hybrid-FSDP).
    dp_outer: int = Field(default=1, ge=1)
    outer_strategy: Literal["no_shard", "optim"] = "no_shard"
    # Mixed precision: main parameters and optimizer state are always fp32.
    param_dtype: Dtype = "fp32"  # compute parameters: what forward and backward run in
    grad_dtype: Dtype = "fp32"  # gradient accumulation
    comm_dtype: Dtype | None = None  # gradient communication; None = grad_dtype
    # auto = dynamic for fp16, none otherwise; a number is a fixed scale.
    loss_scale: Literal["auto", "dynamic", "none"] | float = "auto"
    initial_loss_scale: float = Field(default=2.0**16, gt=0)
    loss_scale_window: int = Field(default=1000, ge=1)  # finite steps before the scale doubles

    @field_validator("fsdp_units", mode="before")
    @classmethod
    def _split(cls, v):
        # From the command line: sharding.fsdp_units=Block,Embedding
        return tuple(s.strip() for s in v.split(",") if s.strip()) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self):
        if self.dp_outer > 1 and self.strategy == "no_shard":
            raise ValueError("dp_outer: hybrid sharding needs a sharded strategy, got no_shard")
        if self.param_dtype == "fp16" and self.loss_scale == "none":
            raise ValueError(
                "loss_scale: fp16 parameters need loss scaling (set sharding.loss_scale=dynamic or a number)"
            )
        if self.strategy == "optim_grads_params" and not self.fsdp_units:
            raise ValueError("fsdp_units: optim_grads_params needs at least one module class")
        return self

    @property
    def effective_comm_dtype(self) -> str:
        return self.comm_dtype or self.grad_dtype


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
