"""Objectives of your own, as the objectives guide (docs/guides/objectives.md) writes them.

    rayzero train train.objective=examples.objectives:LabelSmoothing train.objective_kwargs.epsilon=0.1
"""

from __future__ import annotations

import torch

from rayzero.objectives import Metric, Objective


class LabelSmoothing(Objective):
    """Cross-entropy against targets smoothed toward the uniform distribution:
    (1 - epsilon) x NLL(target) + epsilon x the mean NLL over the vocabulary, at every valid target
    (`torch.nn.functional.cross_entropy(label_smoothing=epsilon)` per token). Reports the plain NLL
    beside it, and the largest NLL of any one token in the step."""

    data_kinds = ("text", "instructions")
    metrics = (Metric("nll", "mean"), Metric("max_token_nll", "max"))
    perplexity = False  # the loss is not a plain cross-entropy

    def __init__(self, cfg, epsilon: float = 0.1):
        super().__init__(cfg)
        self.epsilon = epsilon

    @classmethod
    def check(cls, cfg) -> None:
        if cfg.parallel.tp > 1:
            raise ValueError("reads the whole logits of each token; run without tensor parallelism (parallel.tp=1)")

    def loss(self, out, batch):
        mask = batch.loss_mask
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # [B, T, V]
        nll = -out.token_logps  # [B, T], 0 where the target is masked
        uniform = -logp.mean(-1)  # the NLL of a uniform target over the vocabulary
        per_token = (1 - self.epsilon) * nll + self.epsilon * uniform * mask
        return per_token.sum(), {"nll": nll.sum().detach(), "max_token_nll": nll.max().detach()}


class StayClose(Objective):
    """Next-token loss plus beta x an estimate of KL(policy || reference) at each valid target
    (k3: e^d - d - 1 with d = reference - policy log-probability, as TRL's GRPO estimates its KL
    term), the reference being the starting weights, frozen: fine-tuning that stays near where
    it began. Reports both terms."""

    reference = "frozen_copy"  # the batch then carries `ref_logps`, the reference's log-prob of each target
    metrics = (Metric("nll", "mean"), Metric("kl", "mean"))

    def __init__(self, cfg, beta: float = 0.1):
        super().__init__(cfg)
        self.beta = beta

    def loss(self, out, batch):
        logp, ref, mask = out.token_logps, batch.token_fields["ref_logps"], batch.loss_mask
        d = (ref - logp) * mask
        kl = torch.exp(d) - d - 1  # 0 at masked targets, where d is 0
        nll = -logp
        return (nll + self.beta * kl).sum(), {"nll": nll.sum().detach(), "kl": kl.sum().detach()}
