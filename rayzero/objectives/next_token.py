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

    def rank_side(self, ctx) -> SummedLoss:
        return _NextTokenOnRank(self, ctx)


class _NextTokenOnRank(SummedLoss):
    """The summed cross-entropy and its count from one pass (the model seam's fused loss)."""

    def _loss(self, out: Output, batch):
        loss_sum, valid = out.summed_nll()
        self.loss_sum += loss_sum.detach()
        self.tokens += valid.detach() if hasattr(valid, "detach") else valid  # no wait for the device
        return loss_sum, {}

    def validate(self, val):
        from rayzero.objectives.base import StepSums

        import torch

        ctx = self.ctx
        loss_sum, count = torch.zeros((), dtype=torch.float64, device=ctx.device), 0
        micro = [(b if ctx.cp is None else b.split(ctx.cp)).to(ctx.device)
                 for k in range(val.num_batches) for b in val.microbatches(k)]

        def one(model, batch):
            loss, valid = Output.of(ctx.spec, model, batch, vocab=ctx.vocab).summed_nll()
            return loss, valid

        parts = ctx.pipe.forward_only(micro, one) if ctx.pipe is not None else (one(ctx.model, b) for b in micro)
        for part, valid in parts:
            loss_sum += part.double()
            count += int(valid)
        return StepSums(float(loss_sum), count, {"sum": {}, "max": {}})
