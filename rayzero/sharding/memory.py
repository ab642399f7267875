"""What a rank holds, by category, in bytes: the ledger behind `memory.bytes_per_param`.

Persistent model state is counted where it is allocated; transient buffers (gathered units,
full gradient buckets, communication casts) are counted while they live, and their peak kept.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

# frozen_params: parameters with requires_grad=False, which have no gradient, main copy or
# optimizer state.
CATEGORIES = ("compute_params", "main_params", "optimizer", "grads", "frozen_params")


@dataclass
class MemoryLedger:
    persistent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    transient: int = 0
    transient_peak: int = 0

    def hold(self, category: str, nbytes: int) -> None:
        self.persistent[category] += nbytes

    def grow(self, nbytes: int) -> None:
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    def shrink(self, nbytes: int) -> None:
        self.transient -= nbytes

    def report(self) -> dict[str, int]:
        return {**self.persistent, "total": sum(self.persistent.values()),
                "transient_peak": self.transient_peak}


def bytes_per_param(reports: list[dict[str, int]], num_params: int) -> dict[str, float]:
    """Each category's bytes per model parameter, the max over ranks."""
    keys = [*CATEGORIES, "total"]
    return {k: max(r[k] for r in reports) / num_params for k in keys}


def formula_bytes_per_param(strategy: str, d: int, param_bytes: int = 4, grad_bytes: int = 4,
                            d_optim: int | None = None) -> float:
    """Megatron's model-state bytes per parameter with d data-parallel ranks (fp32 main
    parameters and two fp32 Adam moments; a separate main copy only when params are not fp32).
    `d_optim`: ranks the optimizer state is split over when that differs from d (Hybrid-FSDP
    shards it across the replicas too)."""
    main = 0 if param_bytes == 4 else 4
    p, g, o = param_bytes, grad_bytes, 8 + main
    o_shard = o / (d_optim or d)
    return {
        "no_shard": p + g + o,
        "optim": p + g + o_shard,
        "optim_grads": p + g / d + o_shard,
        "optim_grads_params": (p + g) / d + o_shard,
    }[strategy]


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Every distinct tensor storage alive in this process on `device_type`, in bytes: an
    independent count to hold the ledger against (tensors autograd or torch keep included)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # half-built objects and tensor subclasses that refuse introspection
            continue
    return sum(seen.values())
