"""AdamW over flat shards, matching `torch.optim.AdamW` (decoupled weight decay).

The update is torch's fused AdamW kernel (`torch._fused_adamw_`, what
`torch.optim.AdamW(fused=True)` runs): one pass over parameters, gradients and both moments,
about three times faster on CPU than the multi-pass update of per-op kernels. It takes lists
of tensors and one weight decay per call, so the owned shard is cut once, at setup, into
segments that either all decay or all do not; a step is then two kernel calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayzero.sharding.layout import Range

# Segments are cut to at most this many elements, so a gradient kept in another dtype than
# fp32 (a bf16 gradient buffer) is converted through at most 4 MiB of scratch at a time.
CHUNK = 1 << 20


@dataclass(frozen=True)
class AdamWHyper:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass(frozen=True)
class _Segment:
    index: int  # which of the params/grads lists
    lo: int  # within that tensor
    hi: int
    offset: int  # within the moments
    decays: bool


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
        self.decay_runs = merge_runs(decay_runs)
        numel = sum(p.numel() for p in params)
        device = _device(params)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.step_count = 0
        self._step = torch.zeros((), dtype=torch.float32, device=device)  # the kernel reads it
        self._segments = self._cut(params)
        self._groups = [(d, [s for s in self._segments if s.decays == d]) for d in (True, False)]
        self._views = {d: (self._slices(params, segs), self._moments(segs)) for d, segs in self._groups}
        self._grad_views: tuple[list[tuple[int, int]], dict] | None = None

    def _cut(self, params: list[torch.Tensor]) -> list[_Segment]:
        """Each tensor cut at the decay runs' edges and every CHUNK elements."""
        segments, offset = [], 0
        for i, p in enumerate(params):
            edges = {0, p.numel(), *range(0, p.numel(), CHUNK)}
            for run in self.decay_runs:
                for e in (run.start - offset, run.end - offset):
                    if 0 < e < p.numel():
                        edges.add(e)
            edges = sorted(edges)
            for lo, hi in zip(edges, edges[1:]):
                decays = any(r.start <= offset + lo < r.end for r in self.decay_runs)
                segments.append(_Segment(i, lo, hi, offset + lo, decays))
            offset += p.numel()
        return segments

    @staticmethod
    def _slices(tensors: list[torch.Tensor], segments: list[_Segment]) -> list[torch.Tensor]:
        return [tensors[s.index][s.lo : s.hi] for s in segments]

    def _moments(self, segments: list[_Segment]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cut = lambda t: [t[s.offset : s.offset + s.hi - s.lo] for s in segments]  # noqa: E731
        return cut(self.exp_avg), cut(self.exp_avg_sq)

    def _grads(self, grads: list[torch.Tensor], decays: bool) -> list[torch.Tensor]:
        """The gradient segments; the views are kept while the same tensors come back (the
        strategy passes the same gradient buffers every step), so a step allocates nothing."""
        key = [(g.data_ptr(), g.numel()) for g in grads]
        if self._grad_views is None or self._grad_views[0] != key:
            self._grad_views = (key, {d: self._slices(grads, segs) for d, segs in self._groups})
        return self._grad_views[1][decays]

    def step(self, grads: list[torch.Tensor], lr: float, grad_scale: float | torch.Tensor = 1.0,
             found_inf: torch.Tensor | None = None) -> None:
        """One update with the gradients multiplied by `grad_scale` (the clipping coefficient, a
        number or a scalar on the device: applied inside the kernel, so the gradients are read
        once); none where `found_inf` (an fp32 scalar on the device) is 1."""
        self.step_count += 1
        self._step.fill_(self.step_count)
        if isinstance(grad_scale, torch.Tensor):
            scale = (torch.ones_like(grad_scale) / grad_scale).float()
        else:
            scale = None if grad_scale == 1.0 else torch.full((), 1.0 / grad_scale, device=self._step.device)
        for decays, segments in self._groups:
            if not segments:
                continue
            params, (exp_avg, exp_avg_sq) = self._views[decays]
            g = self._grads(grads, decays)
            if g[0].dtype != torch.float32:  # a gradient in a lower precision: fp32 per segment
                for i in range(len(segments)):
                    self._update([params[i]], [g[i].float()], [exp_avg[i]], [exp_avg_sq[i]], lr, decays, scale,
                                 found_inf)
            else:
                self._update(params, g, exp_avg, exp_avg_sq, lr, decays, scale, found_inf)

    def _update(self, params, grads, exp_avg, exp_avg_sq, lr, decays, scale, found_inf) -> None:
        h = self.hyper
        torch._fused_adamw_(
            params, grads, exp_avg, exp_avg_sq, [], [self._step] * len(params),
            lr=lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay if decays else 0.0, eps=h.eps,
            amsgrad=False, maximize=False, grad_scale=scale, found_inf=found_inf,
        )

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
