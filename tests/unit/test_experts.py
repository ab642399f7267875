"""A mixture of experts' local experts under expert parallelism (`models/hf_experts.py`): one
grouped matmul per projection where torch has one for the device (CPU with this torch), the
family's own loop otherwise, with the same outputs and gradients; one rank's whole ep group here
(ep of 1), so that no process group is needed."""

import pytest
import torch

import rayzero.models.hf_experts as hf_experts
from rayzero.sharding.comm import Axis
from rayzero.sharding.expert_parallel import ExpertParallel


def mixtral(grouped: bool):
    import transformers as tf

    config = tf.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(config)
    hf_experts.split_experts(model, ExpertParallel(Axis(None, 1, 0), grouped_mm=grouped), "mixtral")
    return model


def test_the_grouped_matmul_runs_the_local_experts_as_the_family_s_loop_does(monkeypatch):
    calls = []
    grouped = hf_experts._grouped
    monkeypatch.setattr(hf_experts, "_grouped", lambda *a: calls.append(a[-1]) or grouped(*a))
    x = torch.randint(0, 64, (2, 16))
    out = {}
    for kind in (True, False):
        model = mixtral(kind)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        out[kind] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert calls == [4, 4], "with a grouped matmul each MoE layer's 4 local experts run in one"
    assert torch.equal(out[True][0], out[False][0])
    for name, grad in out[False][1].items():
        assert torch.allclose(out[True][1][name], grad, rtol=1e-5, atol=1e-7), name
    experts = next(m for n, m in mixtral(True).named_modules() if n.endswith("experts"))
    assert experts.num_experts == 4, "the layer's count is restored after the call"


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch without a grouped matmul")
def test_a_device_without_one_takes_the_loop(monkeypatch):
    monkeypatch.setattr(hf_experts, "grouped_mm_on", lambda x, module: False)
    calls = []
    monkeypatch.setattr(hf_experts, "_grouped", lambda *a: calls.append(a))
    x = torch.randint(0, 64, (1, 8))
    assert torch.isfinite(mixtral(True)(input_ids=x).logits).all() and not calls
