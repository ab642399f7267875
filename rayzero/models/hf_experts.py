"""Expert parallelism for Hugging Face mixtures of experts through transformers' experts
registry (`ExpertsInterface`), with no model code edited: each `experts` module (the fused 3-D
expert tensors of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, …) keeps only this rank's E/ep experts
(dim 0 of each of its tensors), and its forward is an implementation rayzero registers that
sends the router's (token, expert) pairs to their experts' ranks (`sharding/expert_parallel.py`)
and runs the family's own expert code on what it receives: transformers' `grouped_mm` experts
forward (one grouped matmul per projection, where torch has one for the device) or the class's
own forward (its loop over the experts), called on the local experts with each received pair's
expert and a weight of one (the router's weights are applied on the tokens' rank, after the
return trip)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from rayzero.models.errors import ModelError

EP_EXPERTS = "rayzero_expert_parallel"  # the experts implementations `split_experts` registers, numbered
_registered = iter(range(1 << 62))  # each model its own (a preference loss's reference is another model)


def _ep_forward(ep, module, hidden_states, top_k_index, top_k_weights):
    own = type(module).forward.__wrapped__  # the family's forward, under transformers' dispatching wrapper

    def run(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                        torch.tensor(counts, device=x.device), output_size=x.shape[0])
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        if ep.grouped_mm and grouped_mm_on(x, module):
            return _grouped(module, x, local[:, None], ones, len(counts))
        return own(module, x, local[:, None], ones)

    return ep.run(hidden_states, top_k_index, top_k_weights, run, module.num_experts)


def grouped_mm_on(x: torch.Tensor, module: nn.Module) -> bool:
    """Whether torch has a grouped matmul for the device of `x` and the module's expert weights
    (transformers' own check: CPU with torch > 2.10, CUDA at compute capability 8.0 and up)."""
    try:
        from transformers.integrations.moe import _can_use_grouped_mm
    except ImportError:
        return False
    weight = next(module.parameters())
    return weight.dim() == 3 and _can_use_grouped_mm(x, weight, None)


def _grouped(module: nn.Module, x: torch.Tensor, ids: torch.Tensor, ones: torch.Tensor, local: int) -> torch.Tensor:
    """transformers' `grouped_mm` experts forward on the rank's `local` experts (the module
    counts the whole layer's; its tensors hold the local ones)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    whole, module.num_experts = module.num_experts, local
    try:
        return grouped_mm_experts_forward(module, x, ids, ones)
    finally:
        module.num_experts = whole


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules named `experts` whose forward transformers' experts registry dispatches."""
    return [(name, m) for name, m in model.named_modules()
            if name.rpartition(".")[2] == "experts" and hasattr(type(m).forward, "__wrapped__")
            and hasattr(m, "num_experts")]


def split_experts(model: nn.Module, ep, where: str) -> dict[str, tuple[int, ...]]:
    """Keep this rank's experts in every `experts` module of `model` (on the meta device) and
    route through `ep` (an `ExpertParallel`): each split tensor's whole shape, by name. ModelError
    for a model with no experts, or experts that the ep size does not divide."""
    from transformers import PreTrainedModel
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    found = experts_modules(model)
    if not found:
        raise ModelError(f"parallel.ep: {where} has no experts to split (expert parallelism splits a mixture of "
                         "experts' `experts` modules, as Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE have); set parallel.ep=1")
    size, rank = ep.axis.size, ep.axis.rank
    whole = {}
    for name, m in found:
        if m.num_experts % size:
            raise ModelError(f"parallel.ep: {size} does not divide the {m.num_experts} experts of {where}; "
                             f"ep must divide {m.num_experts}")
        per = m.num_experts // size
        for pname, p in list(m.named_parameters(recurse=False)):
            if p.shape[0] != m.num_experts:
                raise ModelError(f"parallel.ep: {name}.{pname} of {where} is not one tensor per expert "
                                 f"(shape {tuple(p.shape)}, {m.num_experts} experts)")
            local = torch.empty((per, *p.shape[1:]), dtype=p.dtype, device=p.device)
            if p.device.type != "meta":
                local.copy_(p.detach()[rank * per:(rank + 1) * per])
            setattr(m, pname, nn.Parameter(local, requires_grad=p.requires_grad))
            whole[f"{name}.{pname}"] = tuple(p.shape)
    name = f"{EP_EXPERTS}_{next(_registered)}"
    ALL_EXPERTS_FUNCTIONS.register(name, functools.partial(_ep_forward, ep))
    pretrained = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    pretrained.set_experts_implementation(name)
    return whole
