"""A Hugging Face model's tensor-parallel plan: transformers' own, the config's
`base_model_tp_plan` (keys below the base model), in the two styles of Megatron's split
(`sharding/tensor_parallel.py`).

A mixture of experts' plan may also name its experts (`moe_tp_experts`, the fused 3-D expert
tensors `packed_colwise` / `rowwise`; transformers from 5.25 names them in `base_model_ep_plan`
only): rayzero leaves them whole on every TP rank and splits them over
ranks by expert parallelism instead (Megatron's expert TP of 1). With sequence parallelism the
experts then see a TP rank's share of the tokens, and their gradients are summed over the TP ranks
like the norms'; without it every TP rank routes the same tokens.
"""

from __future__ import annotations

import torch.nn as nn

from rayzero.models.errors import ModelError

STYLES = ("colwise", "rowwise")


def tp_plan(model: nn.Module, config, plan: dict) -> dict:
    """The plan as `tensor_parallel.Style`s: the query heads and the key/value heads named so
    that a size that does not divide them is refused, and key/value heads fewer than the TP
    ranks replicated."""
    from rayzero.sharding.tensor_parallel import Style

    plan = dense_plan(model, plan, moe=bool(getattr(config, "base_model_ep_plan", None)))
    odd = {k: v for k, v in plan.items() if v not in STYLES}
    if odd:
        raise ModelError(f"parallel.tp: {type(model).__name__}'s tensor-parallel plan has styles rayzero does not "
                         f"split by ({', '.join(f'{k}: {v}' for k, v in sorted(odd.items()))}); it splits "
                         f"{' and '.join(STYLES)} linears only")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    prefix = getattr(model, "base_model_prefix", "")
    out = {}
    for key, style in plan.items():
        leaf = key.rpartition(".")[2]
        if style == "rowwise":
            out[f"{prefix}.{key}" if prefix else key] = Style("row")
        else:
            head = {"q_proj": (heads, False), "k_proj": (kv, True), "v_proj": (kv, True)}.get(leaf, (None, False))
            out[f"{prefix}.{key}" if prefix else key] = Style("column", heads=head[0], kv=head[1])
    return out


def dense_plan(model: nn.Module, plan: dict, moe: bool = False) -> dict:
    """A mixture of experts' plan (one that names `moe_tp_experts`, or `moe`: its config has an
    expert-parallel plan) without its experts (the `moe_tp_experts` module and the tensors below
    it), and without the entries no module of this model matches (the dense MLP of the layers a
    config can leave dense, Qwen2-MoE's `mlp_only_layers`). A dense model's plan as it is."""
    from rayzero.sharding.tensor_parallel import matches

    experts = [k for k, v in plan.items() if v == "moe_tp_experts"]
    if not experts and not moe:
        return plan
    kept = {k: v for k, v in plan.items() if not any(k == e or k.startswith(e + ".") for e in experts)}
    prefix = getattr(model, "base_model_prefix", "")
    names = [n for n, _ in model.named_modules()]
    return {k: v for k, v in kept.items() if any(matches(f"{prefix}.{k}" if prefix else k, n) for n in names)}
