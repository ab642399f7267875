"""The arithmetic of GRPO and its kin, as TRL's `GRPOTrainer` (and, for the leave-one-out
baseline, its `RLOOTrainer`) computes it, in the seam's terms: a micro-batch's loss *summed*, and
the count the whole step divides it by. Pure torch, no model, no process group.

The objective that holds it is `grpo.py` (`train.objective=grpo`).

    advantages    rewards [N] (NaN: every reward function declined to score) in groups of
                  `num_generations`: minus the group's mean (`grpo`) or the leave-one-out mean of
                  the others (`rloo`); over the group's std (`scale_rewards=group`), the batch's
                  (`batch`) or not at all (`none`), + 1e-4; unscorable rows 0
    ratio         r = exp(logp - old_logp) per completion token
    per token     -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl,
                  kl = exp(ref - logp) - (ref - logp) - 1 (k3), times r when bias-corrected
    loss_type     grpo     each sequence's mean over its tokens, averaged over the step's sequences
                  bnpo     summed over tokens, over the step's completion tokens
                  dapo     the same (TRL's default; its count is the whole generation batch's)
                  dr_grpo  summed over tokens, over sequences x max_completion_length

TRL divides bnpo by each micro-batch's own tokens; here every divisor is summed over the whole
step, so the loss does not depend on the layout or on the micro-batch split, and equals TRL's
where TRL takes the step as one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCALES = ("group", "batch", "none")
ESTIMATORS = ("grpo", "rloo")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN with one value), as TRL's."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group",
               estimator: str = "grpo") -> tuple[torch.Tensor, torch.Tensor]:
    """(each completion's advantage [N], whether its group's rewards are all equal [N]) from the
    weighted rewards of N completions, `num_generations` a prompt in order (NaN: unscorable)."""
    if scale_rewards not in SCALES:
        raise ValueError(f"scale_rewards: expected one of {', '.join(SCALES)}, got {scale_rewards!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator: expected one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    g = num_generations
    grouped = rewards.view(-1, g)
    group_std = nanstd(grouped, dim=1).repeat_interleave(g) if g > 1 else torch.zeros_like(rewards)
    if estimator == "rloo":
        scorable = (~torch.isnan(grouped)).sum(1, keepdim=True)
        baseline = ((torch.nansum(grouped, 1, keepdim=True) - grouped) / (scorable - 1)).view(-1)
        adv = rewards - baseline if g > 1 else torch.zeros_like(rewards)
    else:
        adv = rewards - torch.nanmean(grouped, dim=1).repeat_interleave(g)
    std = group_std if scale_rewards == "group" else nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 \
        else torch.zeros_like(rewards)
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    shown = std if scale_rewards == "batch" else group_std  # what TRL's frac_reward_zero_std reads
    zero_std = torch.isclose(shown, torch.zeros_like(shown))
    return torch.nan_to_num(adv, nan=0.0), zero_std


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped-ratio loss's settings, in TRL's names."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (clip-higher when larger)
    beta: float = 0.0
    bias_corrected_kl: bool = True  # TRL's use_bias_correction_kl
    max_completion_length: int = 256  # dr_grpo's constant length

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: expected one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.high < self.epsilon:
            raise ValueError(f"epsilon_high: {self.high:g} is below epsilon ({self.epsilon:g})")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def token_losses(self, logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                     adv: torch.Tensor, is_ratio: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(the per-token loss [B, T], the per-token KL or None, the ratio [B, T]) from the
        policy's, the sampling (old) policy's and the reference's per-token log-probabilities
        and each sequence's advantage [B]; `is_ratio` (`ImportanceSampling.weights`) weighs the
        clipped term, as TRL weighs it, before the KL is added."""
        ratio = torch.exp(logps - old_logps)
        a = adv.unsqueeze(1)
        loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - self.epsilon, 1 + self.high) * a)
        if is_ratio is not None:
            loss = loss * is_ratio
        kl = None
        if self.beta != 0.0:
            if ref_logps is None:
                raise ValueError("beta > 0 needs the reference's log-probabilities")
            d = ref_logps - logps
            kl = torch.exp(d) - d - 1
            if self.bias_corrected_kl:
                kl = kl * ratio
            loss = loss + self.beta * kl
        return loss, kl, ratio

    def summed(self, per_token: torch.Tensor, mask: torch.Tensor, length: torch.Tensor | None = None,
               parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(a micro-batch's loss summed, its count): the step's loss is the sum of the first over
        every micro-batch and rank divided by the same sum of the second. With context
        parallelism (`parts` ranks each holding part of every row; `length`: each row's
        completion tokens in the whole row) the per-sequence mean (`grpo`) divides by the whole
        row's length, and the count of rows is this part's share of each (its tokens over the
        row's, 1/parts of a row with none), which the cp group's ranks add up to whole rows."""
        mask = mask.to(per_token.dtype)
        if self.loss_type == "grpo":
            here = mask.sum(-1)
            whole = here if length is None else length.to(per_token.dtype)
            per_seq = (per_token * mask).sum(-1) / whole.clamp(min=1.0)
            return per_seq.sum(), torch.tensor(self.rows(mask, length, parts), device=per_token.device)
        total = (per_token * mask).sum()
        if self.loss_type == "dr_grpo":
            return total, torch.tensor(self.count(mask, length, parts), device=per_token.device)
        return total, mask.sum()

    def rows(self, mask: torch.Tensor, length: torch.Tensor | None, parts: int,
             padding: torch.Tensor | None = None) -> float:
        """The micro-batch's rows, or with context parallelism this part's share of them (rows
        that only pad a short step to whole micro-batches not counted)."""
        if padding is not None:
            real = ~padding.to(mask.device)
            mask, length = mask[real], (None if length is None else length[real])
        if length is None or parts == 1:
            return float(mask.shape[0])
        here, length = mask.double().sum(-1).cpu(), length.double().cpu()
        return float(torch.where(length > 0, here / length.clamp(min=1.0), torch.full_like(here, 1.0 / parts)).sum())

    def count(self, mask: torch.Tensor, length: torch.Tensor | None = None, parts: int = 1,
              padding: torch.Tensor | None = None) -> float:
        """The step's divisor's part from this micro-batch (`loss_type`): its rows (grpo), its
        rows x max_completion_length (dr_grpo), or its completion tokens (bnpo, dapo)."""
        if self.loss_type == "grpo":
            return self.rows(mask, length, parts, padding)
        if self.loss_type == "dr_grpo":
            return self.rows(mask, length, parts, padding) * self.max_completion_length
        return float(mask.sum())

    def metric_sums(self, kl: torch.Tensor | None, ratio: torch.Tensor, adv: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The sums of TRL's per-token metrics over the completion tokens (each a mean over the
        step's completion tokens, `completion_tokens`): kl, and the clipped shares of the ratio."""
        m = mask.to(ratio.dtype)
        a = adv.unsqueeze(1)
        low = ((ratio < 1 - self.epsilon) & (a < 0)).to(ratio.dtype)
        high = ((ratio > 1 + self.high) & (a > 0)).to(ratio.dtype)
        out = {"clip_ratio/low_mean": (low * m).sum(), "clip_ratio/high_mean": (high * m).sum(),
               "clip_ratio/region_mean": (torch.maximum(low, high) * m).sum(), "completion_tokens": m.sum()}
        if kl is not None:
            out["kl"] = (kl * m).sum()
        return {k: v.detach() for k, v in out.items()}


@dataclass(frozen=True)
class ImportanceSampling:
    """The correction for completions sampled by another policy than the trainer's (stale weights,
    another engine), as TRL's `vllm_importance_sampling_mode` computes it: the ratio of the
    trainer's log-probabilities at generation (`old`) to the sampler's, per token or per sequence
    (the sum of a row's), truncated to [clip_min, clip_max] or set to 0 outside them."""

    mode: str = "none"
    clip_max: float | None = 3.0
    clip_min: float | None = None

    def __post_init__(self):
        if self.mode not in IS_MODES:
            raise ValueError(f"is_correction: expected one of {', '.join(IS_MODES)}, got {self.mode!r}")

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")

    def weights(self, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, whole=None) -> torch.Tensor:
        """The ratio [B, T] (a sequence's repeated on each of its tokens; all 1 with mode `none`).
        `whole`: a row's sum over this part's tokens made the whole row's (context parallelism)."""
        diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
        if self.per_sequence:
            diff = diff.sum(-1, keepdim=True)
            diff = whole(diff) if whole is not None else diff
        ratio = torch.exp(diff)
        if self.mode.endswith("truncate") and (self.clip_min is not None or self.clip_max is not None):
            ratio = torch.clamp(ratio, min=self.clip_min, max=self.clip_max)
        elif self.mode.endswith("mask"):
            lo = self.clip_min if self.clip_min is not None else -math.inf
            hi = self.clip_max if self.clip_max is not None else math.inf
            ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
        return ratio.expand_as(old).contiguous() if self.mode != "none" else torch.ones_like(old)

    def metric_sums(self, old: torch.Tensor, sampler: torch.Tensor, ratio: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The mismatch between trainer and sampler, TRL's names (sums over completion tokens, or
        over rows for a sequence-level ratio, `is_count`; maxima), and its KL (k3, ≥ 0)."""
        m = mask.bool() & ~torch.isnan(sampler)
        d = torch.where(m, old - sampler, torch.zeros_like(old))
        zero = torch.zeros((), dtype=old.dtype, device=old.device)
        out = {"sampling/sampling_logp_difference/mean": d.abs().sum(),
               "sampling/sampling_logp_difference/max": d.abs().max() if d.numel() else zero,
               "sampling/kl": torch.where(m, torch.exp(d) - 1 - d, zero).sum()}
        if self.per_sequence:
            rows = m.any(-1)
            seq = ratio[:, 0]
            out.update({"sampling/importance_sampling_ratio/mean": (seq * rows).sum(), "is_count": rows.sum().to(old.dtype),
                        "sampling/importance_sampling_ratio/max": seq[rows].max() if rows.any() else zero})
        else:
            out.update({"sampling/importance_sampling_ratio/mean": (ratio * m).sum(), "is_count": m.sum().to(old.dtype),
                        "sampling/importance_sampling_ratio/max": ratio[m].max() if m.any() else zero})
        return {k: v.detach() for k, v in out.items()}


RAW_RATIO = ImportanceSampling("token_truncate", None, None)  # the ratio as it is: what `none` reports


class PolicyObjective:
    """GRPO's loss over a micro-batch of rollouts, in the seam's terms (`Objective.loss` and
    `count`), for the objective that will hold it. A rollout row is a prompt and one completion:
    its targets IGNORE_INDEX but on the completion's tokens; its row field `advantage`; its token
    fields `old_logps` (the log-probabilities of the first pass over its generation batch; absent:
    this pass is the first), with beta > 0 `ref_logps`, and with an importance-sampling correction
    `is_ratio`."""

    def __init__(self, policy: PolicyLoss, temperature: float = 1.0, parts: int = 1):
        self.policy, self.temperature, self.parts = policy, temperature, parts  # parts: the cp size

    def count(self, batch) -> torch.Tensor:
        return torch.tensor(self.policy.count(batch.loss_mask, batch.row_fields.get("length"), self.parts,
                                              batch.row_fields.get("padding")), dtype=torch.float64)

    def loss(self, out, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logps = out.tempered_logps(self.temperature)
        old = batch.token_fields.get("old_logps")
        old = logps.detach() if old is None else old
        adv = batch.row_fields["advantage"]
        per_token, kl, ratio = self.policy.token_losses(logps, old, batch.token_fields.get("ref_logps"), adv,
                                                        batch.token_fields.get("is_ratio"))
        mask = batch.loss_mask
        total, _ = self.policy.summed(per_token, mask, batch.row_fields.get("length"), self.parts)
        return total, self.policy.metric_sums(kl, ratio, adv, mask)
