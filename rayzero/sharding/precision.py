"""The mixed-precision policy: compute parameters in `param_dtype`, fp32 main parameters and
optimizer state, gradients accumulated in `grad_dtype` and communicated in `comm_dtype`;
fp16 adds dynamic loss scaling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rayzero.sharding.config import ShardingConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    param: torch.dtype
    grad: torch.dtype
    comm: torch.dtype
    main: torch.dtype = torch.float32
    main_is_param: bool = field(init=False)  # fp32 compute parameters are their own main copy: no second fp32 buffer

    def __post_init__(self):
        object.__setattr__(self, "main_is_param", self.param == self.main)

    @classmethod
    def from_config(cls, cfg: ShardingConfig) -> "Precision":
        return cls(DTYPES[cfg.param_dtype], DTYPES[cfg.grad_dtype], DTYPES[cfg.effective_comm_dtype])


def check_device_supports(dtype: torch.dtype, device: torch.device) -> None:
    """Raise a ValueError naming the dtype and device if a transformer's ops fail in it there."""
    try:
        x = torch.randn(2, 4, 8, device=device).to(dtype).requires_grad_()
        w = torch.randn(8, 8, device=device).to(dtype)
        y = F.layer_norm(F.linear(x, w), (8,))
        q = y.view(2, 4, 2, 4).transpose(1, 2)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum().backward()
        if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise RuntimeError("torch.cuda.is_bf16_supported() is False")
    except (RuntimeError, AssertionError) as e:  # AssertionError: a torch built without CUDA
        raise ValueError(f"{device.type} cannot compute in {dtype}: {e}") from None


class LossScaler:
    """Dynamic loss scaling (as torch.amp.GradScaler): multiply the loss by `scale`; a step
    whose gradients hold inf/NaN is skipped and the scale halves; after `window` finite steps
    in a row it doubles."""

    def __init__(self, initial: float, window: int, dynamic: bool = True):
        self.scale = float(initial)
        self.window = window
        self.dynamic = dynamic
        self._good = 0

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self._good = 0
            return
        self._good += 1
        if self._good == self.window:
            self.scale *= 2
            self._good = 0


def build_loss_scaler(cfg: ShardingConfig) -> LossScaler | None:
    mode = cfg.loss_scale
    if mode == "auto":
        mode = "dynamic" if cfg.param_dtype == "fp16" else "none"
    if mode == "none":
        return None
    if mode == "dynamic":
        return LossScaler(cfg.initial_loss_scale, cfg.loss_scale_window)
    return LossScaler(float(mode), cfg.loss_scale_window, dynamic=False)
