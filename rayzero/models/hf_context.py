"""Context parallelism for Hugging Face decoders through transformers' attention-function
registry (`AttentionInterface`), with no model code edited: every attention layer calls
`cp.attend` (with the key/value heads as the layer has them, before `repeat_kv`), and the model
is given the tokens' global `position_ids`, which the rotary or learned positions take (packed
rows: the positions in each token's example, and the examples' starts, `DOCUMENTS`, passed on to
`cp.attend`). An implementation name with no mask function of its own makes transformers build
no mask: causality (and each example's bounds) is over the global positions, in `cp.attend`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.nn as nn

CP_ATTENTION = "rayzero_context_parallel"  # the attention implementation `attend_across` registers
# The model call's keyword for packed rows' example starts (`data/microbatch.py`): transformers passes a forward's
# extra keyword arguments on through its decoder layers to the attention function, which gives them to `cp.attend`.
DOCUMENTS = "rayzero_documents"


@dataclass
class Calls:
    """With `expect` (set by the seam for packed rows), the attention calls across the split since
    `missed` was last set to 0 that were not given the rows' example starts: a family whose layers
    do not pass their forward's keyword arguments on to the attention would let packed examples
    attend to each other. Unchanged otherwise: a compiled block's guards see the same values at
    every call, and nothing is compiled again."""

    expect: bool = False
    missed: int = 0


def _cp_attention(cp, calls: Calls, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention function of transformers' registry: this rank's queries against the whole
    sequence across the cp group; [batch, tokens, heads, head dim] as transformers' own return."""
    window = kwargs.get("sliding_window")
    if (window and window < cp.seq_len) or kwargs.get("s_aux") is not None:  # refused before training by the seam
        raise ValueError(f"{type(module).__name__}: sliding-window or sink attention across the context-parallel "
                         "split is not supported")
    documents = kwargs.get(DOCUMENTS)
    if calls.expect and documents is None:
        calls.missed += 1
    return cp.attend(query, key, value, dropout, scale=scaling, documents=documents).transpose(1, 2).contiguous(), None


def attend_across(model: nn.Module, cp, config) -> Calls:
    """Make `model` (a transformers model, possibly with adapters, of text config `config`) attend
    across the split of `cp` (a `ContextParallel`) and take its tokens' global positions; what
    counts its attention calls. A ModelError for attention the split does not do yet."""
    from transformers import AttentionInterface, PreTrainedModel

    check_splittable(model, config, cp.seq_len)
    calls = Calls()
    AttentionInterface.register(CP_ATTENTION, functools.partial(_cp_attention, cp, calls))
    pretrained = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    pretrained.set_attn_implementation(CP_ATTENTION)

    def positions(_module, args, kwargs):
        if kwargs.get("position_ids") is not None:  # packed rows' own, restarting at each example
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        return args, {**kwargs, "position_ids": cp.local_positions(ids.shape[1], ids.device)[None]}

    model.register_forward_pre_hook(positions, with_kwargs=True)
    return calls


def packed_across(model: nn.Module, kwargs: dict, documents, calls: Calls):
    """The forward of packed rows across the split: every attention call given the examples'
    starts, or a ModelError naming the family whose layers do not pass them on."""
    from rayzero.models.spec import ModelError

    calls.expect, calls.missed = True, 0
    try:
        return model(**kwargs, **{DOCUMENTS: documents})
    finally:
        if calls.missed:
            raise ModelError(f"parallel.cp: {type(model).__name__}'s layers do not pass their keyword arguments on to "
                             "the attention, so the packed examples' bounds never reach the attention across the split; "
                             "set parallel.cp=1 for packed data with this model")


def check_splittable(model: nn.Module, config, seq_len: int) -> None:
    """A ModelError naming the model for attention the split does not do yet: sinks (GPT-OSS's
    learned per-head logits), a sliding window shorter than the sequence."""
    from rayzero.models.spec import ModelError

    what = type(model).__name__
    if any(n.rpartition(".")[2] == "sinks" for n, _ in model.named_parameters()):
        raise ModelError(f"parallel.cp: {what}'s attention has sinks (a learned logit per head that every query also "
                         "attends to), which attention across the context-parallel split does not do yet; set "
                         "parallel.cp=1")
    window = sliding_window(config)
    if window is not None and window < seq_len:
        raise ModelError(f"parallel.cp: {what}'s layers attend within a sliding window of {window} tokens, which "
                         "attention across the context-parallel split does not do yet; set parallel.cp=1, or "
                         f"train.seq_len={window} or less (a window that long is whole causal attention)")


def sliding_window(config) -> int | None:
    """The sliding window some of the model's layers attend within (None: every layer attends
    to the whole causal past): the config's `sliding_window` where its `layer_types` have
    sliding layers or, without them, where `use_sliding_window` (if it has one) is on."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    return int(window) if getattr(config, "use_sliding_window", True) else None
