"""Pipeline parallelism through a Hugging Face model equals plain torch on the same model.

A tiny Llama (4 decoder layers, GQA, RoPE) built by transformers and cut into 2 stages by its
decoder layers: `model.embed_tokens` on the first stage, `model.norm` and `lm_head` on the
last. Untied, under every schedule; tied (`lm_head.weight` is `model.embed_tokens.weight`, so
the one tensor lives on both stages and its gradients are summed over them) under 1f1b. After
10 steps every parameter matches `torch.optim.AdamW` on `from_pretrained`'s model within 1e-5
relative, the reported loss the reference's, and rank 0's export holds every name of the
model's own state dict.
"""

import pytest

from tests.dist.reference import train_reference
from tests.dist.test_models import STEPS, assert_matches, config, reference_model, run_ranks
from tests.models import save_hf_model

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)  # 4 layers: interleaved at pp 2 x 2 chunks holds one per stage

SCHEDULES = [
    ("gpipe", ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    ("1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    ("interleaved", ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"]),
    ("zero_bubble", ["parallel.pp=2", "parallel.pp_schedule=zero_bubble"]),
]


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pp-llama")
    return {"llama": str(save_hf_model("llama", root / "tied", seed=1, **LLAMA)),
            "llama-untied": str(save_hf_model("llama-untied", root / "untied", seed=2, **LLAMA))}


def check(name: str, runs, llama_dirs, data_path: str, world: int = 2, accum: int = 2) -> dict:
    """`runs` against single-process torch; by default 4 micro-batches per step through 2 stages."""
    keys = ["model.kind=hf", f"model.path={llama_dirs[name]}"]
    base = config(world, accum, keys)
    ref_state, ref_losses = train_reference(reference_model(name, base, llama_dirs), base, data_path, STEPS)
    cfgs = [(label, config(world, accum, keys, extra)) for label, extra in runs]
    results = run_ranks(world, cfgs, data_path)
    for label, _ in runs:
        assert_matches(results, label, world, ref_state, ref_losses)
    return results


@pytest.mark.slow
def test_llama_every_schedule_equals_the_reference(llama_dirs, small_dataset):
    results = check("llama-untied", SCHEDULES, llama_dirs, small_dataset)
    stage0, stage1 = (results[("1f1b", r)]["info"]["params"] for r in (0, 1))
    assert "model.embed_tokens.weight" in stage0 and "model.embed_tokens.weight" not in stage1
    assert "lm_head.weight" in stage1 and "lm_head.weight" not in stage0
    assert "model.layers.0.self_attn.q_proj.weight" in stage0 and "model.layers.3.mlp.up_proj.weight" in stage1
    assert not set(stage0) & set(stage1), "untied: no parameter on both stages"


@pytest.mark.slow
def test_tied_llama_sums_the_shared_weight_over_stages(llama_dirs, small_dataset):
    results = check("llama", SCHEDULES[1:2], llama_dirs, small_dataset)
    stage0, stage1 = (results[("1f1b", r)]["info"]["params"] for r in (0, 1))
    # the head's weight is the embedding's: one name (the model's first for it), on both stages
    assert set(stage0) & set(stage1) == {"model.embed_tokens.weight"}
    assert "lm_head.weight" not in stage1
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(results[("1f1b", 0)]["state"])


@pytest.mark.slow
def test_tied_llama_in_stages_sharded_by_zero3(llama_dirs, small_dataset):
    """pp 2 x dp 2, each stage's units ZeRO-3's (the decoder layers, the embedding, the head):
    a stage has the classes its modules have, the tied embedding a unit on both end stages."""
    check("llama", [(s, ["parallel.pp=2", f"sharding.strategy={s}"]) for s in ("optim_grads_params", "optim_grads")],
          llama_dirs, small_dataset, world=4, accum=1)


MOE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_router_loss_spans_the_stages(arch, tmp_path, small_dataset):
    """The router loss (weighted up to show in a short run) is transformers' over every layer's router logits: each stage passes its
    layers' logits on with the activations, the last computes the loss, and its gradient reaches
    every stage's routers: equal to the single-process model with its router loss."""
    dirs = {arch: str(save_hf_model(arch, tmp_path / arch, seed=3, **MOE))}
    check(arch, [("1f1b", ["parallel.pp=2"]), ("zero_bubble", ["parallel.pp=2", "parallel.pp_schedule=zero_bubble"])],
          dirs, small_dataset)


FAMILY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma", "phi", "gpt_neox", "gpt2"])
def test_each_decoder_family_splits_by_its_layers(arch, tmp_path, small_dataset):
    """Each family's own forward runs a stage: its embedding (scaled, with dropout, or with
    positions) on the first, its norm and head on the last, its decoder layers between. Against
    the same run at pp 1 (data parallel): the pipeline changes nothing but where the work runs."""
    shape = dict(n_embd=64, n_layer=4, n_head=4) if arch == "gpt2" else dict(FAMILY)
    if arch == "gpt_neox":  # no fused q|k|v bias: its key part would only drift with rounding (see key_bias)
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     attention_bias=False)
    path = save_hf_model(arch, tmp_path / arch, seed=4, **shape)
    keys = ["model.kind=hf", f"model.path={path}"]
    runs = [(label, config(2, 2, keys, extra)) for label, extra in (("pp1", []), ("pp2", ["parallel.pp=2"]))]
    results = run_ranks(2, runs, small_dataset)
    losses = [sum(results[("pp1", r)]["losses"][k][0] for r in range(2))
              / sum(results[("pp1", r)]["losses"][k][1] for r in range(2)) for k in range(STEPS)]
    assert_matches(results, "pp2", 2, results[("pp1", 0)]["state"], losses)
