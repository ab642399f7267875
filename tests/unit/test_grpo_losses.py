"""GRPO's arithmetic (`rayzero/objectives/grpo_loss.py`) against TRL's own code on the same tensors:
TRL's `GRPOTrainer._compute_loss` run on one batch (its model's log-probabilities given), for every
loss type, beta 0 and > 0, with and without the bias-corrected KL, clip-higher and on- or
off-policy ratios: the loss, its gradient, the KL and the clip ratios TRL logs. Its advantages
against TRL's formulas (`GRPOTrainer`, and `RLOOTrainer`'s leave-one-out baseline), unscorable
completions included. Then what the seam adds: the step's loss from summed parts is the same
however the batch is split into micro-batches."""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rayzero.objectives.grpo_loss import IS_MODES, ImportanceSampling, PolicyLoss, advantages

B, T, MAX_LEN = 6, 7, 7


def batch(seed: int, off_policy: bool):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + (torch.randn(B, T, generator=g) * 0.3 if off_policy else 0.0)
    ref = logps + torch.randn(B, T, generator=g) * 0.2
    mask = torch.ones(B, T)
    for i, n in enumerate([7, 5, 3, 7, 1, 4]):
        mask[i, n:] = 0
    adv = torch.randn(B, generator=g)
    return logps, old, ref, mask, adv


class Accelerator:  # one process: TRL's collectives are the identity
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_loss(cfg: PolicyLoss, logps, old, ref, mask, adv, is_ratio=None):
    """TRL's `_compute_loss`, its model's forward replaced by the given log-probabilities: (loss,
    metrics); `is_ratio`: its importance-sampling ratio (TRL's with vLLM's log-probabilities)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    this = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=cfg.beta, loss_type=cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.high,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=cfg.max_completion_length,
        accelerator=Accelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=cfg.bias_corrected_kl, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum(), **({"importance_sampling_ratio": is_ratio} if is_ratio is not None else {})}
    loss = GRPOTrainer._compute_loss(this, None, inputs)
    return loss, {k: v[-1] for k, v in this._metrics["train"].items()}


def ours(cfg: PolicyLoss, logps, old, ref, mask, adv, splits=(B,), is_ratio=None):
    """The step's loss from each micro-batch's summed part and count, and its metrics."""
    parts, sums = [], defaultdict(float)
    at = 0
    for n in splits:
        s = slice(at, at + n)
        at += n
        per_token, kl, ratio = cfg.token_losses(logps[s], old[s], ref[s], adv[s],
                                                is_ratio[s] if is_ratio is not None else None)
        parts.append(cfg.summed(per_token, mask[s]))
        for k, v in cfg.metric_sums(kl, ratio, adv[s], mask[s]).items():
            sums[k] += float(v)
    loss = sum(p for p, _ in parts) / sum(c for _, c in parts)
    n = sums.pop("completion_tokens")
    return loss, {k: v / n for k, v in sums.items()}


CASES = list(itertools.product(["grpo", "bnpo", "dapo", "dr_grpo"], [0.0, 0.04], [True, False], [True, False]))


@pytest.mark.parametrize("loss_type,beta,bias_corrected,off_policy", CASES)
def test_the_loss_its_gradient_and_metrics_are_trls(loss_type, beta, bias_corrected, off_policy):
    cfg = PolicyLoss(loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta, bias_corrected_kl=bias_corrected,
                     max_completion_length=MAX_LEN)
    logps, old, ref, mask, adv = batch(4, off_policy)
    a, b = logps.clone().requires_grad_(), logps.clone().requires_grad_()
    want, trl_metrics = trl_loss(cfg, a, old, ref, mask, adv)
    got, metrics = ours(cfg, b, old, ref, mask, adv)
    assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
    want.backward(), got.backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    for k, v in metrics.items():
        assert v == pytest.approx(trl_metrics[k], rel=1e-6, abs=1e-7), k
    assert ("kl" in metrics) == (beta != 0.0)
    if off_policy:  # the clip engages, both ways
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_the_steps_loss_does_not_depend_on_the_micro_batch_split(loss_type):
    cfg = PolicyLoss(loss_type, beta=0.04, max_completion_length=MAX_LEN)
    logps, old, ref, mask, adv = batch(5, True)
    whole, m_whole = ours(cfg, logps, old, ref, mask, adv)
    for splits in [(3, 3), (1, 2, 3), (5, 1)]:
        part, m_part = ours(cfg, logps, old, ref, mask, adv, splits)
        assert part.item() == pytest.approx(whole.item(), rel=1e-6)
        assert m_part == pytest.approx(m_whole, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_the_loss_of_rows_split_along_the_sequence_adds_up_to_the_whole_rows(loss_type):
    """Context parallelism: each part of a cp group holds some of every row's tokens; with the
    whole rows' lengths the parts' sums and counts add up to the whole rows' (a row with no
    completion token, masked, still counts as one row, shared evenly)."""
    cfg = PolicyLoss(loss_type, beta=0.04, max_completion_length=MAX_LEN)
    logps, old, ref, mask, adv = batch(5, True)
    mask[2] = 0  # a masked truncated completion
    per_token, _, _ = cfg.token_losses(logps, old, ref, adv)
    whole, count = cfg.summed(per_token, mask)
    length = mask.sum(-1)
    for cuts in [(0, 3, MAX_LEN), (0, 1, 4, MAX_LEN)]:
        parts = len(cuts) - 1
        got = [cfg.summed(per_token[:, a:b], mask[:, a:b], length, parts) for a, b in zip(cuts, cuts[1:])]
        assert float(sum(g for g, _ in got)) == pytest.approx(float(whole), rel=1e-6)
        assert float(sum(c for _, c in got)) == pytest.approx(float(count), rel=1e-12)
        assert sum(cfg.count(mask[:, a:b], length, parts) for a, b in zip(cuts, cuts[1:])) == \
            pytest.approx(float(count), rel=1e-12)


def trl_advantages(rewards, g, scale, estimator):
    """TRL's formulas, as its trainers write them (grpo_trainer.py, rloo_trainer.py)."""
    from trl.trainer.utils import nanstd

    grouped = rewards.view(-1, g)
    std_group = nanstd(grouped, dim=1).repeat_interleave(g)
    if estimator == "rloo":
        scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        adv = rewards - ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)).view(-1)
    else:
        adv = rewards - torch.nanmean(grouped, dim=1).repeat_interleave(g)
    std = std_group if scale in ("group", "none") else nanstd(rewards).expand_as(rewards)
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("scale,estimator", list(itertools.product(["group", "batch", "none"], ["grpo", "rloo"])))
def test_advantages_are_trls_with_unscorable_completions(scale, estimator):
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, float("nan"), 0.2, 0.9, 0.0])
    got, zero = advantages(rewards, 4, scale, estimator)
    want, want_zero = trl_advantages(rewards, 4, scale, estimator)
    assert torch.allclose(got, want, atol=1e-7) and torch.equal(zero, want_zero)
    assert got[8] == 0.0  # unscorable: no signal
    if scale == "group":
        assert torch.equal(got[4:8], torch.zeros(4)) and zero[4:8].all()  # a group of equal rewards: nothing to learn


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="epsilon_high: 0.1 is below epsilon"):
        PolicyLoss(epsilon=0.2, epsilon_high=0.1)
    with pytest.raises(ValueError, match="loss_type: expected one of grpo, bnpo, dapo, dr_grpo"):
        PolicyLoss("ppo")
    with pytest.raises(ValueError, match="beta > 0 needs the reference"):
        PolicyLoss(beta=0.1).token_losses(*[torch.zeros(1, 2)] * 2, None, torch.zeros(1))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_a_rollout_micro_batchs_loss_on_the_seam_is_trls_at_its_temperature(loss_type):
    """`PolicyObjective` as the seam runs it: each micro-batch's loss summed and its count, from
    the model's logits at the sampling temperature, the advantages and old log-probabilities as
    the batch's fields; summed over two micro-batches and divided, TRL's loss on the whole batch."""
    from rayzero.data.microbatch import MicroBatch
    from rayzero.objectives.base import Output
    from rayzero.objectives.grpo_loss import PolicyObjective

    class Spec:
        def aux_loss(self, raw):
            return None

    temperature, vocab = 0.7, 13
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(B, T, vocab, generator=g)
    targets = torch.randint(0, vocab, (B, T), generator=g)
    _, old, ref, mask, adv = batch(4, True)
    targets[mask == 0] = -100
    logps = torch.log_softmax(logits / temperature, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0] * mask
    cfg = PolicyLoss(loss_type, epsilon=0.2, epsilon_high=0.28, beta=0.04, max_completion_length=MAX_LEN)
    want, trl_metrics = trl_loss(cfg, logps, old, ref, mask, adv)
    objective, parts, sums = PolicyObjective(cfg, temperature), [], defaultdict(float)
    for s in (slice(0, 2), slice(2, B)):
        mb = MicroBatch(torch.zeros_like(targets[s]), targets[s]).with_fields(
            rows={"advantage": adv[s]}, tokens={"old_logps": old[s], "ref_logps": ref[s]})
        total, metrics = objective.loss(Output(Spec(), logits[s], logits[s], mb), mb)
        parts.append((total, objective.count(mb)))
        for k, v in metrics.items():
            sums[k] += float(v)
    got = sum(p for p, _ in parts) / sum(c for _, c in parts)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    n = sums.pop("completion_tokens")
    for k, v in sums.items():
        assert v / n == pytest.approx(trl_metrics[k], rel=1e-5, abs=1e-7), k


def trl_is_ratio(mode: str, old, sampling, mask, clip_max, clip_min):
    """TRL's importance-sampling ratio as its trainer writes it (`_generate_and_score_completions`,
    `vllm_importance_sampling_mode`), and the metrics it logs of it."""
    import math

    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    sequence = mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence else diff)
    if mode in ("sequence_truncate", "token_truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        lo = clip_min if clip_min is not None else -math.inf
        hi = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)
    delta = torch.abs(old - sampling)[mask.bool()]
    flat = ratio.flatten() if sequence else ratio[mask.bool()]
    return ratio, {"sampling/sampling_logp_difference/mean": float(delta.mean()),
                   "sampling/sampling_logp_difference/max": float(delta.max()),
                   "sampling/importance_sampling_ratio/mean": float(flat.mean()),
                   "sampling/importance_sampling_ratio/max": float(flat.max())}


@pytest.mark.parametrize("mode,clip", list(itertools.product(IS_MODES[1:], [(3.0, None), (1.2, 0.8)])))
def test_importance_sampling_is_trls_and_weighs_the_loss_as_trls_does(mode, clip):
    """The ratio of the trainer's log-probabilities at generation to the sampler's (another
    engine, stale weights), each mode and bound, and the loss it weighs: TRL's, with its
    `_compute_loss` on the same ratio (its vLLM path)."""
    clip_max, clip_min = clip
    logps, old, ref, mask, adv = batch(7, True)
    sampling = old + torch.randn(B, T, generator=torch.Generator().manual_seed(3)) * 0.15
    want, want_metrics = trl_is_ratio(mode, old, sampling, mask, clip_max, clip_min)
    s = ImportanceSampling(mode, clip_max, clip_min)
    got = s.weights(old, sampling, mask)
    assert torch.allclose(got, want.expand_as(got), rtol=1e-6, atol=0)
    sums = s.metric_sums(old, sampling, got, mask)
    count, tokens = float(sums["is_count"]), float(mask.sum())
    assert float(sums["sampling/sampling_logp_difference/mean"]) / tokens == pytest.approx(
        want_metrics["sampling/sampling_logp_difference/mean"], rel=1e-6)
    for name in ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/max"):
        assert float(sums[name]) == pytest.approx(want_metrics[name], rel=1e-6), name
    assert float(sums["sampling/importance_sampling_ratio/mean"]) / count == pytest.approx(
        want_metrics["sampling/importance_sampling_ratio/mean"], rel=1e-6)
    assert float(sums["sampling/kl"]) >= 0
    for loss_type in ("grpo", "dapo"):
        cfg = PolicyLoss(loss_type, beta=0.04, max_completion_length=MAX_LEN)
        theirs, _ = trl_loss(cfg, logps, old, ref, mask, adv, is_ratio=want)
        mine, _ = ours(cfg, logps, old, ref, mask, adv, is_ratio=got)
        assert mine.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7), loss_type


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_a_short_step_runs_fewer_micro_batches_whose_padding_counts_nowhere(loss_type):
    """Dynamic sampling's round still short: the ranks pad its rows to whole micro-batches with
    rows that take no part, so the step's loss is the real rows' (a completion left out as
    truncated still counting as a row, as TRL's does), in fewer micro-batches when it can."""
    from rayzero.data.rollouts import RolloutBatches

    rows = [{"ids": list(range(3, 8 + k)), "start": 4, "advantage": k - 2.0, "logps": None} for k in range(5)]
    rows[1]["masked"] = True
    cfg = PolicyLoss(loss_type, max_completion_length=8)

    def step(rows, global_batch, micro, dp):
        out = []
        for rank in range(dp):
            b = RolloutBatches(None, seed=0, global_batch=global_batch, micro_batch=micro, seq_len=12, dp_rank=rank,
                               dp_size=dp)
            b.take({"step": 0, "rows": rows})
            out += b.microbatches(0)
        return out

    def loss(micro):
        total = count = 0.0
        for b in micro:
            logps = -(b.tokens.float() + 1) / 50
            per_token, _, _ = cfg.token_losses(logps, logps.detach(), None, b.row_fields["advantage"], None)
            total += float(cfg.summed(per_token, b.loss_mask, b.row_fields["length"])[0])
            count += cfg.count(b.loss_mask, b.row_fields["length"], 1, b.row_fields.get("padding"))
        return total / count

    short = step(rows, 8, 2, 2)  # 5 rows of a batch of 8: padded to 8, 2 micro-batches on each of 2 ranks
    assert len(short) == 4 and sum(int(b.row_fields["padding"].sum()) for b in short) == 3
    assert loss(short) == pytest.approx(loss(step(rows, 5, 1, 1)), rel=1e-6)
    shorter = step(rows[:3], 8, 2, 2)  # 3 rows: 1 micro-batch a rank instead of 2
    assert len(shorter) == 2 and loss(shorter) == pytest.approx(loss(step(rows[:3], 3, 1, 1)), rel=1e-6)
    assert "padding" not in step(rows[:4], 4, 2, 2)[0].row_fields  # a full step: as before
