"""Preference losses over pairs of completions, as TRL's `DPOTrainer` (and, for `orpo`, its
`ORPOTrainer`) computes them. Pure torch: no process groups, no model.

A preference micro-batch holds pairs as rows (2i, 2i + 1) = (chosen, rejected) of pair i, each
row's labels IGNORE_INDEX except on its completion's tokens (`data/preferences.py`). From the
per-token cross-entropy of the policy (and the reference's sequence log-probabilities):

    logp(seq)  = sum over the completion's tokens of log p(token | before)   (TRL: summed)
    margin     = (logp_c - ref_c) - (logp_r - ref_r)
    sigmoid    = -log σ(β margin)
    robust     = (-(1 - ε) log σ(β margin) + ε log σ(-β margin)) / (1 - 2ε)   (ε = label_smoothing)
    hinge      = relu(1 - β margin)
    ipo        = ((logp_c - ref_c)/n_c - (logp_r - ref_r)/n_r - 1/(2β))²    (per completion token)
    orpo       = NLL of the chosen completions' tokens (their mean over the batch; ORPO's L_SFT,
                 where TRL's ORPOTrainer takes the prompt's tokens too) - β log σ(log odds),
                 log odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)), a = logp / n

The loss of a step is the mean over its pairs (ORPO's NLL: over its chosen tokens): each rank
sums over its pairs and divides by the step's global count, so that summed over micro-batches
and ranks the gradient is that of the mean, at any world size. Empty pairs (the filler at the
end of an epoch) have no completion tokens and take no part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayzero.objectives.config import DPOConfig
from rayzero.sharding.vocab_parallel import IGNORE_INDEX

# What a run reports of its pairs, under TRL's names: each the mean over the step's pairs.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation (branching at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass
class Pairs:
    """One micro-batch's pairs, seen through its labels: the completion tokens each chosen and
    rejected row has, and which pairs are real (not filler)."""

    chosen_tokens: torch.Tensor  # [P], float
    rejected_tokens: torch.Tensor  # [P], float
    valid: torch.Tensor  # [P], bool

    @classmethod
    def of(cls, targets: torch.Tensor) -> "Pairs":
        return cls.counted(row_tokens(targets))

    @classmethod
    def counted(cls, tokens: torch.Tensor) -> "Pairs":
        """From each row's completion tokens (`row_tokens`: [rows], float)."""
        if tokens.shape[0] % 2:
            raise ValueError(f"a preference micro-batch holds pairs of rows; this one has {tokens.shape[0]} rows")
        chosen, rejected = tokens[0::2], tokens[1::2]
        return cls(chosen, rejected, (chosen > 0) & (rejected > 0))


def row_tokens(targets: torch.Tensor) -> torch.Tensor:
    """Each row's completion tokens (its targets not IGNORE_INDEX), float: [rows, T] -> [rows]."""
    return (targets != IGNORE_INDEX).sum(-1).float()


def sequence_logps(token_losses: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its completion: minus its per-token cross-entropy summed
    (0 where the label is IGNORE_INDEX). [rows, T] -> [rows]."""
    return -token_losses.sum(-1)


def counts(targets: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[pairs, chosen completion tokens] of a micro-batch's real pairs, float64 on the targets'
    device: what a step divides its loss by, summed over micro-batches and ranks (`tokens`: the
    rows' completion tokens, when the targets are a part of each row)."""
    pairs = Pairs.of(targets) if tokens is None else Pairs.counted(tokens)
    return torch.stack([pairs.valid.sum(), (pairs.chosen_tokens * pairs.valid).sum()]).double()


class PreferenceLoss:
    """`dpo.loss` over one micro-batch: its part of the step's mean loss, and the sums of the
    metrics over its real pairs (divided by the step's pair count when reported)."""

    def __init__(self, cfg: DPOConfig):
        self.cfg = cfg

    def __call__(self, token_losses: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None,
                 divisors: tuple[float, float], tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """`token_losses`: the policy's per-token cross-entropy [rows, T] (fp32; or each row's
        sum, [rows, 1], with `tokens`: the rows' completion tokens); `ref`: the reference's
        sequence log-probabilities [rows] (None for a reference-free loss); `divisors`: the
        step's (pairs, chosen completion tokens) over every rank. The sums are 0-d float64
        tensors on the loss's device (`as_floats` reads them)."""
        cfg, beta = self.cfg, self.cfg.beta
        pairs = Pairs.of(targets) if tokens is None else Pairs.counted(tokens)
        logps = sequence_logps(token_losses)
        chosen, rejected = logps[0::2], logps[1::2]
        n_c, n_r = pairs.chosen_tokens.clamp(min=1.0), pairs.rejected_tokens.clamp(min=1.0)
        extra: dict[str, torch.Tensor] = {}
        if cfg.loss == "orpo":
            avg_c, avg_r = chosen / n_c, rejected / n_r
            log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
            ratio = F.logsigmoid(log_odds)
            nll_sum = token_losses[0::2].sum(-1)  # the chosen rows' cross-entropy, summed
            per_pair = -beta * ratio
            r_chosen, r_rejected = beta * avg_c.detach(), beta * avg_r.detach()
            loss = (nll_sum * pairs.valid).sum() / max(divisors[1], 1.0)
            shown_c, shown_r = avg_c, avg_r  # TRL's ORPO logs the per-token mean log-probabilities
            extra = {"nll_loss": nll_sum.detach() * divisors[0] / max(divisors[1], 1.0),
                     "log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
        else:
            if ref is None:
                raise ValueError(f"dpo.loss={cfg.loss} compares with a reference model, and none was given")
            ref_c, ref_r = ref[0::2], ref[1::2]
            lr_c, lr_r = chosen - ref_c, rejected - ref_r
            margin = lr_c - lr_r
            eps = cfg.label_smoothing
            if cfg.loss == "sigmoid":
                per_pair = -F.logsigmoid(beta * margin)
            elif cfg.loss == "robust":
                per_pair = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
            elif cfg.loss == "hinge":
                per_pair = torch.relu(1 - beta * margin)
            elif cfg.loss == "ipo":
                per_pair = (lr_c / n_c - lr_r / n_r - 1 / (2 * beta)) ** 2
            else:
                raise ValueError(f"dpo.loss: unknown loss {cfg.loss!r}")
            r_chosen, r_rejected = beta * lr_c.detach(), beta * lr_r.detach()
            loss = torch.zeros((), dtype=per_pair.dtype, device=per_pair.device)
            shown_c, shown_r = chosen, rejected
        loss = loss + (per_pair * pairs.valid).sum() / max(divisors[0], 1.0)
        valid = pairs.valid
        values = {
            "rewards/chosen": r_chosen, "rewards/rejected": r_rejected,
            "rewards/accuracies": (r_chosen > r_rejected).float(), "rewards/margins": r_chosen - r_rejected,
            "logps/chosen": shown_c.detach(), "logps/rejected": shown_r.detach(), **extra,
        }
        sums = {k: (v.double() * valid).sum() for k, v in values.items()}
        # the step's loss, as summed over ranks: this micro-batch's part of it, times the pair count
        sums["loss"] = loss.detach().double() * divisors[0]
        sums["pairs"] = valid.sum().double()
        return loss, sums


def add_sums(total: dict, part: dict) -> dict:
    """`part`'s sums added into `total`'s, key by key (tensors stay on their device)."""
    for k, v in part.items():
        total[k] = total[k] + v if k in total else v
    return total


def as_floats(sums: dict) -> dict[str, float]:
    """The sums as numbers, read from the device in one go (once a step, not per micro-batch)."""
    if not sums:
        return {}
    keys = list(sums)
    return dict(zip(keys, torch.stack([sums[k] for k in keys]).tolist()))


def pair_metrics(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """The step's means over its pairs, by TRL's names (`prefix`: `val_` for validation)."""
    n = max(sums.get("pairs", 0.0), 1.0)
    return {f"{prefix}{k}": v / n for k, v in sums.items() if k not in ("pairs", "loss")}
