"""AdamW over flat shards, matching `torch.optim.AdamW` (decoupled weight decay) op for op."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rayzero.sharding.layout import Range

CHUNK = 1 << 20  # elements updated per pass: bounds the scratch at 4 MiB, costs ~1 µs/MiB of calls


@dataclass(frozen=True)
class AdamWHyper:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


class FlatAdamW:
    """AdamW on one rank's shard.

    `params` and `grads` are lists of views (one per bucket slice owned by the rank); the
    moments are contiguous local buffers in the same order. `decay_runs` are the local
    ranges whose elements belong to parameters that take weight decay: a shard that cuts
    through several parameters decays exactly the right elements.
    """

    def __init__(self, params: list[torch.Tensor], hyper: AdamWHyper, decay_runs: list[Range]):
        self.params = params
        self.hyper = hyper
        self.decay_runs = decay_runs
        numel = sum(p.numel() for p in params)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=_device(params))
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        # One scratch for the denominator, reused chunk by chunk: no step-sized temporaries.
        self._denom = torch.empty(min(max((p.numel() for p in params), default=0), CHUNK),
                                  dtype=torch.float32, device=self.exp_avg.device)
        self.step_count = 0
        self._offsets = []
        acc = 0
        for p in params:
            self._offsets.append(acc)
            acc += p.numel()

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        h = self.hyper
        self.step_count += 1
        bc1 = 1 - h.beta1**self.step_count
        bc2_sqrt = math.sqrt(1 - h.beta2**self.step_count)
        step_size = lr / bc1
        self._decay(lr)
        for p, g, off in zip(self.params, grads, self._offsets):
            for lo in range(0, p.numel(), CHUNK):
                hi = min(lo + CHUNK, p.numel())
                m = self.exp_avg[off + lo : off + hi]
                v = self.exp_avg_sq[off + lo : off + hi]
                gc = g[lo:hi].float()
                m.lerp_(gc, 1 - h.beta1)
                v.mul_(h.beta2).addcmul_(gc, gc, value=1 - h.beta2)
                denom = torch.sqrt(v, out=self._denom[: hi - lo]).div_(bc2_sqrt).add_(h.eps)
                p[lo:hi].addcdiv_(m, denom, value=-step_size)

    def _decay(self, lr: float) -> None:
        if self.hyper.weight_decay == 0:
            return
        factor = 1 - lr * self.hyper.weight_decay
        for run in self.decay_runs:
            for p, off in zip(self.params, self._offsets):
                cut = run.intersect(Range(off, off + p.numel()))
                if cut is not None:
                    p[cut.start - off : cut.end - off].mul_(factor)

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def _device(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def merge_runs(runs: list[Range]) -> list[Range]:
    """Sorted, with touching or overlapping ranges joined (so no element decays twice)."""
    merged: list[Range] = []
    for r in sorted(runs, key=lambda r: r.start):
        if merged and merged[-1].end >= r.start:
            merged[-1] = Range(merged[-1].start, max(merged[-1].end, r.end))
        else:
            merged.append(r)
    return merged
