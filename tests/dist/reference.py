"""A plain single-process torch run, to hold sharded training against: the same model and
initial weights, the whole global batch of every step (micro-batch by micro-batch, gradients
accumulated), the loss summed over valid targets / their global count, clipping,
`torch.optim.AdamW` with weight decay on matrices only, and rayzero's learning-rate schedule; a
mixture of experts adds its router loss (and z-loss), weighted by its coefficient, per micro-batch, averaged
over the step's micro-batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from rayzero.cluster.schedule import lr_at
from rayzero.data.batches import global_batch_offsets
from rayzero.data.tokens import TokenDataset


def mask_targets(y: torch.Tensor) -> torch.Tensor:
    """Padding-like masking, a function of the data alone: targets that are a space, a newline
    or an underscore do not count (about a fifth of source code)."""
    return y.masked_fill((y == 32) | (y == 10) | (y == 95), -100)


class MaskedBatches:
    """A rank's batches with `mask_targets` applied: labels of -100, as instruction data has."""

    masks_labels = True

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def microbatches(self, step: int):
        return [dataclasses.replace(b, targets=mask_targets(b.targets)) for b in self.inner.microbatches(step)]


def global_rows(cfg, data_path: str, step: int) -> torch.Tensor:
    ds, t = TokenDataset(data_path), cfg.train
    offsets = global_batch_offsets(t.seed, step, t.global_batch_size, ds.num_tokens, t.seq_len)
    return torch.from_numpy(np.stack([ds.window(int(s), t.seq_len + 1) for s in offsets]))


def unpacked(x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows (inputs, targets, where each token's example starts) as one row per example
    with a target, padded on the right (token 0, no target): each example trained by itself,
    as the packed row's per-example attention must train it."""
    if documents is None:
        return x, y
    rows = []
    for r in range(x.shape[0]):
        for start in documents[r].unique().tolist():
            keep = documents[r] == start
            if (y[r][keep] != -100).any():
                rows.append((x[r][keep], y[r][keep]))
    width = max(len(a) for a, _ in rows)
    inputs = torch.zeros(len(rows), width, dtype=x.dtype)
    targets = torch.full((len(rows), width), -100, dtype=y.dtype)
    for i, (a, b) in enumerate(rows):
        inputs[i, :len(a)], targets[i, :len(b)] = a, b
    return inputs, targets


def forward(model, x: torch.Tensor, documents: torch.Tensor | None = None, **kwargs):
    """`model`'s forward of `x`; of packed rows (`documents`: where each token's example starts),
    each example kept apart by the model's own means, as the user of each kind writes it: an HF
    model (under PEFT too) its restarting position ids, the built-in GPT its `documents`, a
    module `position_ids` and `document_ids`."""
    if documents is None:
        return model(x, **kwargs)
    from transformers import PreTrainedModel

    from rayzero.models.gpt import GPT

    positions = torch.arange(x.shape[1]) - documents
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(base, PreTrainedModel):
        return model(input_ids=x, position_ids=positions, use_cache=False, **kwargs)
    if isinstance(base, GPT):
        return model(x, documents)
    return model(x, position_ids=positions, document_ids=documents)


def logits_of(model, x):
    out = model(x)
    return getattr(out, "logits", out)


def router_coef(model) -> float:
    """A mixture of experts' router-loss weight (transformers' `router_aux_loss_coef`), else 0."""
    config = getattr(model, "config", None)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if hasattr(config, "output_router_logits") else 0.0


def train_reference(model, cfg, data_path: str, steps: int, masked: bool = False,
                    check_clipping: bool = True, batch=None,
                    norms: list | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train `model` (already holding its initial weights) for `steps`; its final state dict
    and each step's global loss. `batch(step) -> (inputs, targets[, documents])`: the global
    batch, when it is not text windows at `global_rows` (packed examples: their rows with where
    each token's example starts, see `forward`, or `unpacked`, one row each); `norms`: each step's gradient norm appended to it."""
    params = list(model.named_parameters())
    o, t = cfg.optim, cfg.train
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in params if p.dim() >= 2 and p.requires_grad], "weight_decay": o.weight_decay},
         {"params": [p for n, p in params if p.dim() < 2 and p.requires_grad], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
    )
    losses = []
    for step in range(steps):
        documents = None
        if batch is not None:
            inputs, targets, *documents = batch(step)
            documents = documents[0] if documents else None
        else:
            rows = global_rows(cfg, data_path, step)
            inputs, targets = rows[:, :-1], mask_targets(rows[:, 1:]) if masked else rows[:, 1:]
        docs = documents.split(t.micro_batch_size) if documents is not None else [None] * len(inputs)
        valid = int((targets != -100).sum())
        opt.zero_grad()
        loss = 0.0
        coef, micro, z = router_coef(model), len(inputs) // t.micro_batch_size, cfg.moe.router_z_loss
        for x, y, d in zip(inputs.split(t.micro_batch_size), targets.split(t.micro_batch_size), docs):
            out = forward(model, x, d, output_router_logits=True) if coef else forward(model, x, d)
            mb = F.cross_entropy(getattr(out, "logits", out).flatten(0, 1), y.flatten(), reduction="sum",
                                 ignore_index=-100)
            # a mixture of experts: its router loss, per micro-batch, averaged over the step's micro-batches
            # and its router z-loss (ST-MoE's: each layer's mean of logsumexp(logits)^2, summed over layers)
            aux = (coef * out.aux_loss + z * sum(torch.logsumexp(g, -1).square().mean() for g in out.router_logits)
                   ) / micro if coef else 0.0
            (mb / valid + aux).backward()
            loss += mb.item() / valid
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in params if p.requires_grad], o.grad_clip)
        if norms is not None:
            norms.append(float(norm))
        if check_clipping:
            assert norm > o.grad_clip or step > 0, "clipping must engage for the comparison to mean anything"
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, o)
        opt.step()
        losses.append(loss)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error, the usual measure for a whole tensor (elementwise ratios
    blow up on elements that are near zero in both)."""
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()
