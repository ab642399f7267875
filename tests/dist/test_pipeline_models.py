"""Pipeline parallelism through more Hugging Face decoder families than the configurations'
(tests/dist/test_combinations.py runs Llama tied and untied, Qwen2, GPT-2, Mixtral and
Qwen2-MoE under every schedule): Mistral, Gemma (a scaled embedding), Phi and GPT-NeoX, each
cut into 2 stages by its decoder layers, equal the same run at pp 1 within 1e-5.
"""

import pytest

from tests.dist.test_models import STEPS, assert_matches, config, run_ranks
from tests.models import save_hf_model


FAMILY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
FAMILIES = ["mistral", "gemma", "phi", "gpt_neox"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_each_decoder_family_splits_by_its_layers(arch, tmp_path, small_dataset):
    """Each family's own forward runs a stage: its embedding (scaled, with dropout, or with
    positions) on the first, its norm and head on the last, its decoder layers between. Against
    the same run at pp 1 (data parallel): the pipeline changes nothing but where the work runs."""
    shape = dict(FAMILY)
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
