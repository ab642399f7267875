"""Next-token prediction (`train.objective=lm`): the cross-entropy of each valid target (not
IGNORE_INDEX: an instruction's prompt, a row's padding), summed, over the step's count of them.
On text every target counts, so the divisor is known before the step; on masked data each rank
counts its rows' valid targets on the host and the `loss` role sums them."""

from __future__ import annotations

from rayzero.objectives.base import Objective, Output, SummedLoss


class NextToken(Objective):
    data_kinds = ("text", "instructions")
    perplexity = True
    summary = None
    fine_tuning_lr = (2e-5, 2e-4)  # TRL's SFTConfig for a full fine-tune; about ten times that with LoRA

    def loss(self, out: Output, batch):
        loss_sum, _ = out.summed_nll()
        return loss_sum, {}

    def plan(self, params_per_rank, frozen_bytes_per_param, param_dtype) -> None:
        return None  # the default: the plan says nothing of it

    def rank_side(self, ctx) -> SummedLoss:
        return _NextTokenOnRank(self, ctx)


class _NextTokenOnRank(SummedLoss):
    """The summed cross-entropy and its count from one pass (the model seam's fused loss); the
    rest, validation included, as every summed loss."""

    def _loss(self, out: Output, batch):
        loss_sum, valid = out.summed_nll()
        self.loss_sum += loss_sum.detach()
        self.tokens += valid.detach() if hasattr(valid, "detach") else valid  # no wait for the device
        return loss_sum, {}
