"""A mixture of experts' experts behind expert parallelism's seam (`models/hf_experts.py`), for the
families transformers' experts registry serves (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE, OLMoE), with no model code edited: routed through the dispatch, each family trains as
transformers' own model does, and a rank's experts run in one grouped matmul per projection where
torch has one for the device (CPU with this torch), or the family's own loop, with the same
outputs and gradients. One rank's whole ep group here (ep of 1), so that no process group is
needed; the dispatch across ranks: tests/dist/test_expert_parallel.py."""

import pytest
import torch

import rayzero.models.hf_experts as hf_experts
from rayzero.sharding.comm import Axis
from rayzero.sharding.expert_parallel import ExpertParallel

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
FAMILIES = {  # config class, its experts' keys (4 experts, top-2)
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                                         num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, eos_token_id=0,
                                  pad_token_id=1)),
}


def model(family: str, grouped: bool | None):
    """The family's tiny model from seed 0; `grouped` not None: its experts behind the seam."""
    import transformers as tf

    name, keys = FAMILIES[family]
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(getattr(tf, name)(**SMALL, **keys))
    if grouped is not None:
        hf_experts.split_experts(m, ExpertParallel(Axis(None, 1, 0), grouped_mm=grouped), family)
    return m


def loss_and_grads(m, x):
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_through_the_dispatch_as_transformers_own_model(family, monkeypatch):
    calls = []
    grouped = hf_experts._grouped
    monkeypatch.setattr(hf_experts, "_grouped", lambda *a: calls.append(a[-1]) or grouped(*a))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    want, want_grads = loss_and_grads(model(family, None), x)
    for kind in (True, False):
        got, grads = loss_and_grads(model(family, kind), x)
        assert torch.equal(got, want), (kind, float(got), float(want))
        assert grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-7), (kind, name)
    assert calls == [4, 4], "with a grouped matmul each MoE layer's 4 local experts run in one"
    experts = next(m for n, m in model(family, True).named_modules() if n.endswith("experts"))
    assert experts.num_experts == 4, "the layer's count is restored after the call"


def test_a_device_without_one_takes_the_loop(monkeypatch):
    monkeypatch.setattr(hf_experts, "grouped_mm_on", lambda x, module: False)
    calls = []
    monkeypatch.setattr(hf_experts, "_grouped", lambda *a: calls.append(a))
    x = torch.randint(0, 64, (1, 8))
    assert torch.isfinite(model("mixtral", True)(input_ids=x).logits).all() and not calls


# Qwen2-MoE's tensor-parallel plan as transformers 5.24 writes it (its experts named, with
# `moe_tp_experts`) and as 5.25 does (the experts in `base_model_ep_plan` only). Either way
# rayzero splits the attention and leaves the experts (and the dense MLP no layer has) out.
ATTENTION = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
             "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
DENSE_MLP = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
             "layers.*.mlp.down_proj": "rowwise"}
EXPERTS = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
           "layers.*.mlp.experts": "moe_tp_experts"}


@pytest.mark.parametrize("release", ["experts in the tp plan", "experts in the ep plan only"])
def test_a_mixture_of_experts_tp_plan_is_its_attention_under_either_release(release):
    import transformers as tf

    from rayzero.models.hf_plan import tp_plan

    plan = {**ATTENTION, **(EXPERTS if release == "experts in the tp plan" else {}), **DENSE_MLP}
    config = tf.Qwen2MoeConfig(**SMALL, **FAMILIES["qwen2_moe"][1])
    m = tf.AutoModelForCausalLM.from_config(config)
    styles = tp_plan(m, config, plan)
    assert {k: s.kind for k, s in styles.items()} == {
        "model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
        "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row"}


def test_a_dense_models_plan_entry_that_matches_nothing_is_kept_to_be_refused():
    import transformers as tf

    from rayzero.models.hf_plan import tp_plan

    config = tf.LlamaConfig(**SMALL, intermediate_size=24)
    m = tf.AutoModelForCausalLM.from_config(config)
    styles = tp_plan(m, config, {**ATTENTION, "layers.*.mlp.no_such_proj": "colwise"})
    assert "model.layers.*.mlp.no_such_proj" in styles
