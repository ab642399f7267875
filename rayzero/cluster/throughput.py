"""Throughput in the units people compare: tokens/s per rank, and model FLOPs utilization
(MFU) where the device's peak is known.

MFU = achieved model FLOPs / peak FLOPs, with the model's training FLOPs per token from the
model seam (6N plus attention's 12·L·d·T, PaLM appendix B) and the peak of the device's dense
bf16 tensor-core math (the number vendors and papers quote MFU against, whatever dtype the
run computes in). A CPU has no such published peak: MFU is left out there rather than made up.
"""

from __future__ import annotations

# Dense (not 2:4 sparse) bf16 peak FLOP/s, from each vendor's data sheet; the first name that
# occurs in `torch.cuda.get_device_name()` wins, so more specific names come first.
PEAK_BF16_FLOPS = (
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),  # SXM
    ("H800", 989.4e12),
    ("B200", 2250.0e12),
    ("A100", 312.0e12),
    ("A800", 312.0e12),
    ("L40S", 362.05e12),
    ("L40", 181.0e12),
    ("L4", 121.0e12),
    ("A10G", None),  # not A10's numbers: unknown rather than wrong
    ("A10", 125.0e12),
)


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s; None for a CPU or a device not in the table."""
    for name, flops in PEAK_BF16_FLOPS:
        if name in device_name:
            return flops
    return None


def throughput(tokens_per_s: float, world_size: int, flops_per_token: float, device_name: str) -> dict:
    """tokens/s per rank, the model FLOP/s per rank, and MFU (None where the peak is unknown)."""
    per_rank = tokens_per_s / world_size
    achieved = per_rank * flops_per_token
    peak = peak_flops(device_name)
    return {"tokens_per_s_per_rank": per_rank, "model_flops_per_s_per_rank": achieved,
            "mfu": achieved / peak if peak else None, "peak_flops": peak, "device_name": device_name}
