"""Megatron's vocabulary-parallel embedding, output head and cross-entropy.

The vocabulary's rows are split over the TP group: rank t holds rows [t·r, (t+1)·r) of the
embedding (and of the head, one parameter when they are tied), r = ceil(V / tp). A vocabulary the
TP size does not divide is padded, as Megatron pads it: the last rank's last rows are no token.
They start at zero, no id looks them up, their logits are -inf in the loss (so they never win
the softmax and get no gradient, and stay zero), and checkpoints and exports hold only the V real
rows (`tensor_parallel.Split(padded=True)` maps them to nothing).

    embedding   each rank looks up the ids in its rows (zero for the others) and the partial
                results are summed over the group (Megatron's "g": an all-reduce; with sequence
                parallelism too, as the first block splits the sequence after the lookup, where
                the built-in GPT adds its position embeddings to the whole sequence)
    head        column-parallel: "f" on the final hidden state (identity forward, all-reduce of
                its gradient), then this rank's r logits per token
    loss        cross-entropy on the logit shards: the row maximum, the sum of exponentials and
                the target's logit reduced over the group (two all-reduces of a few floats per
                token), never the full logits; backward is local (softmax minus the target's
                one-hot, on this rank's columns)

So a rank holds V/tp of the head's weight and of the logits ([batch, seq, V/tp], and the fp32
softmax the loss keeps for backward) instead of all V.

Pure torch (no Ray).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from rayzero.sharding.comm import Axis
from rayzero.sharding.tp_comm import copy_to_tp, reduce_from_tp

IGNORE_INDEX = -100  # the loss's convention (torch's and HF's)


@dataclass(frozen=True)
class VocabShard:
    """This TP rank's rows of a vocabulary of `size` ids: [start, start + rows), of which the
    first `real` are tokens and the rest padding."""

    axis: Axis
    size: int

    @property
    def rows(self) -> int:
        return -(-self.size // self.axis.size)

    @property
    def start(self) -> int:
        return self.axis.rank * self.rows

    @property
    def real(self) -> int:
        return max(0, min(self.rows, self.size - self.start))

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the targets that are not IGNORE_INDEX, in fp32, and their
        count, from this rank's logit shard [batch, seq, rows]: `token_loss` of the whole logits."""
        per_token = _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), self)
        return per_token.sum(), (targets != IGNORE_INDEX).sum()

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each target's cross-entropy [batch, seq] in fp32 (0 where IGNORE_INDEX), from this
        rank's logit shard: the whole logits' per-token cross-entropy."""
        return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), self).view(targets.shape)


    @torch.no_grad()
    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each position's entropy of the softmax over the whole vocabulary [batch, seq], in
        fp32, from this rank's logit shard (a metric: no gradient)."""
        x = logits.float()
        if self.real < self.rows:
            x = x.masked_fill(torch.arange(self.rows, device=x.device) >= self.real, float("-inf"))
        top = x.amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.axis.group)
        shifted = x - top.unsqueeze(-1)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted.masked_fill(exp == 0, 0.0)).sum(-1)])
        dist.all_reduce(sums, group=self.axis.group)
        return sums[0].log() - sums[1] / sums[0]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        group = shard.axis.group
        x = logits.float()  # may be `logits` itself: never written to
        if shard.real < shard.rows:  # padding rows: never a token, never in the softmax
            x = x.masked_fill(torch.arange(shard.rows, device=x.device) >= shard.real, float("-inf"))
        top = x.amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (x - top.unsqueeze(-1)).exp_()
        valid = targets != IGNORE_INDEX
        local = targets - shard.start
        mine = valid & (local >= 0) & (local < shard.real)
        index = local.clamp(0, shard.rows - 1).masked_fill(~mine, 0)
        picked = (x.gather(1, index.unsqueeze(-1)).squeeze(-1) - top).masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(dim=-1), picked])  # one all-reduce for both
        dist.all_reduce(sums, group=group)
        loss = (sums[0].log() - sums[1]).masked_fill(~valid, 0.0)
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, mine, valid = ctx.saved_tensors
        g = grad.float().masked_fill(~valid, 0.0)
        out = softmax.mul_(g.unsqueeze(-1))  # the saved softmax is not needed again
        out.scatter_add_(1, index.unsqueeze(-1), (-g).masked_fill(~mine, 0.0).unsqueeze(-1))
        return out.to(ctx.dtype), None, None


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding table; the lookups of the ids outside them are zero
    and the partial results are summed over the TP group."""

    shard: VocabShard
    local_padding_idx: int | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.local_padding_idx)
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.shard.axis)


class VocabParallelHead(nn.Linear):
    """Column-parallel output head: this rank's vocabulary rows of the logits."""

    shard: VocabShard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.shard.axis), self.weight, self.bias)


def why_not_split(embedding: nn.Module | None, head: nn.Module | None) -> str | None:
    """Why the vocabulary of this embedding and head cannot be split (None: it can). Only the
    plain layers are split: a subclass may compute something of its own (a scaled embedding), a
    wrapper (PEFT's modules_to_save, a LoRA head) holds the layer elsewhere."""
    if embedding is None or head is None:
        return "it has no " + ("input embedding" if embedding is None else "output head") + " to split"
    for what, module, plain in (("input embedding", embedding, nn.Embedding), ("output head", head, nn.Linear)):
        if hasattr(module, "base_layer"):  # PEFT's LoRA layer around it
            return f"its {what} carries LoRA adapters (model.lora.target_modules names it)"
        if type(module) is not plain:
            kind = type(module)
            return f"its {what} is a {kind.__module__}.{kind.__qualname__}, not a plain nn.{plain.__name__}"
    if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
        return "its input embedding renormalizes rows or has sparse or frequency-scaled gradients"
    if head.weight is not embedding.weight and head.out_features != embedding.num_embeddings:
        return (f"its output head's {head.out_features} outputs are not the embedding's "
                f"{embedding.num_embeddings} rows")
    return None


def split_embedding(embedding: nn.Embedding, shard: VocabShard) -> VocabParallelEmbedding:
    """`embedding`'s vocabulary-parallel version, parameters on the meta device."""
    # Storage given, so that it skips its own init: on the meta device its normal_ would import
    # torch._dynamo, 1.4 s of each rank's start-up.
    new = VocabParallelEmbedding(shard.rows, embedding.embedding_dim, _weight=torch.empty(
        shard.rows, embedding.embedding_dim, device="meta", dtype=embedding.weight.dtype))
    new.shard = shard
    pad = embedding.padding_idx
    if pad is not None and 0 <= pad - shard.start < shard.real:  # that row gets no gradient, as in the whole table
        new.local_padding_idx = pad - shard.start
    new.weight.requires_grad_(embedding.weight.requires_grad)
    return new


def split_head(head: nn.Linear, shard: VocabShard, tied: nn.Parameter | None) -> VocabParallelHead:
    """`head`'s vocabulary-parallel version; `tied`: the split embedding's weight, which it shares."""
    new = VocabParallelHead(head.in_features, shard.rows, bias=head.bias is not None, device="meta",
                            dtype=head.weight.dtype)
    new.shard = shard
    if tied is not None:
        new.weight = tied
    else:
        new.weight.requires_grad_(head.weight.requires_grad)
    if head.bias is not None:
        new.bias.requires_grad_(head.bias.requires_grad)
    return new
