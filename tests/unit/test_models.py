"""The model seam without a process group: building on meta, seeded initialization, pretrained
weights read by range, FSDP unit defaults, and each bad input's message."""

import json
import struct

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from rayzero.config import ConfigError, load_config
from rayzero.data.microbatch import MicroBatch
from rayzero.models import ModelError, model_spec
from rayzero.models.config import ModelConfig
from rayzero.models.weights import SafetensorsWeights
from rayzero.sharding.flat_buffer import Piece
from tests.models import TinyLM, save_hf_model


def spec_of(*overrides, seed: int = 0):
    cfg = load_config(None, list(overrides))
    return model_spec(cfg.model, seed=seed, block_size=cfg.block_size, storage_cfg=cfg.checkpoint)


def init_values(spec, order=None) -> dict[str, torch.Tensor]:
    model = spec.build()
    source = spec.source(model)
    named = dict(model.named_parameters())
    out = {}
    for n in order or named:
        out[n] = torch.empty(named[n].shape)
        source.fill(n, out[n])
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory.mktemp("llama") / "m")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_hf_model("gpt2", tmp_path_factory.mktemp("gpt2") / "m", n_layer=8)


# --------------------------------------------------------------------------- building


def test_hf_build_on_meta_keeps_buffers_real_and_the_tie(llama_dir):
    import transformers as tf

    model = spec_of("model.kind=hf", f"model.path={llama_dir}").build()
    assert all(p.device.type == "meta" for p in model.parameters())
    plain = tf.AutoModelForCausalLM.from_pretrained(str(llama_dir))
    buffers = dict(model.named_buffers())
    assert buffers, "RoPE frequencies"
    for name, b in plain.named_buffers():  # computed by the constructor, not left on meta
        assert b.device.type == "cpu" and torch.equal(buffers[name], b), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_default_fsdp_units_come_from_the_model(llama_dir, gpt2_dir):
    llama = spec_of("model.kind=hf", f"model.path={llama_dir}")
    assert llama.fsdp_units(llama.build()) == ("LlamaDecoderLayer", "Embedding", "Linear")
    gpt2 = spec_of("model.kind=hf", f"model.path={gpt2_dir}")
    assert gpt2.fsdp_units(gpt2.build()) == ("GPT2Block", "Embedding", "Linear")
    module = spec_of("model.kind=module", "model.factory=tests.models:TinyLM")
    assert module.fsdp_units(module.build()) == ("Block",)
    gpt = spec_of()
    assert gpt.fsdp_units(gpt.build()) == ("Block", "Embedding", "LayerNorm", "Linear")


def test_a_unit_class_that_matches_nothing_lists_the_model_classes(llama_dir):
    with pytest.raises(ConfigError, match=r"no module of LlamaForCausalLM has class Block; its module classes "
                                          r"are .*LlamaDecoderLayer"):
        from rayzero.jobs.train import check_model

        check_model(load_config(None, ["model.kind=hf", f"model.path={llama_dir}",
                                       "sharding.strategy=optim_grads_params", "sharding.fsdp_units=Block"]))


# ----------------------------------------------------------------------- initialization


def test_hf_random_init_is_a_function_of_seed_and_names(llama_dir):
    keys = ["model.kind=hf", f"model.path={llama_dir}", "model.init=random"]
    a = init_values(spec_of(*keys, seed=3))
    b = init_values(spec_of(*keys, seed=3), order=list(reversed(list(a))))  # another order: same values
    c = init_values(spec_of(*keys, seed=4))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    # Different modules draw different values, and the model's own scheme applies.
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"][:4],
                           a["model.layers.1.self_attn.q_proj.weight"][:4])
    assert a["model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert (a["model.norm.weight"] == 1).all() and (a["model.layers.1.input_layernorm.weight"] == 1).all()


def test_gpt2_init_runs_the_ancestors_init_too(gpt2_dir):
    """GPT-2's `_init_weights` rescales `c_proj.weight` from the attention module, the parent:
    the chain of inits (module, then ancestors) reproduces it."""
    v = init_values(spec_of("model.kind=hf", f"model.path={gpt2_dir}", "model.init=random"))
    residual = 0.02 / (2 * 8) ** 0.5
    assert v["transformer.h.0.attn.c_proj.weight"].std().item() == pytest.approx(residual, rel=0.15)
    assert v["transformer.h.0.attn.c_attn.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert (v["transformer.h.0.attn.c_attn.bias"] == 0).all()


def test_module_init_seeds_reset_parameters_by_name():
    keys = ["model.kind=module", "model.factory=tests.models:TinyLM"]
    a, b = init_values(spec_of(*keys)), init_values(spec_of(*keys))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # nn.MultiheadAttention zeroes its out_proj bias after out_proj's own reset: the chain runs both.
    assert (a["layers.0.attn.out_proj.bias"] == 0).all() and (a["layers.0.attn.in_proj_bias"] == 0).all()
    assert a["emb.weight"].std().item() == pytest.approx(1.0, rel=0.1)  # nn.Embedding's own N(0, 1)


def test_a_parameter_no_reset_initializes_takes_its_constructor_value(caplog):
    spec = spec_of("model.kind=module", "model.factory=tests.models:Scaled")
    v = init_values(spec)
    assert (v["gain"] == 0.5).all()
    assert "have parameters but no reset_parameters()" in caplog.text


def test_gpt_spec_gives_build_model_weights():
    from rayzero.models.gpt import build_model

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4)
    spec = model_spec(cfg, seed=5, block_size=16)
    plain = dict(build_model(cfg, 16, seed=5).named_parameters())
    got = init_values(spec)
    assert got.keys() == plain.keys() and all(torch.equal(got[k], plain[k].detach()) for k in got)


def test_gpt_starts_from_a_safetensors_export(tmp_path):
    """model.path for the GPT: a file of its state_dict (a tied weight under both names)."""
    from safetensors.torch import save_file

    from rayzero.models.gpt import build_model

    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4)
    trained = build_model(cfg, 16, seed=9).state_dict()
    save_file({k: v.clone() for k, v in trained.items()}, str(tmp_path / "w.safetensors"))
    spec = model_spec(ModelConfig(n_layer=2, n_embd=32, n_head=4, path=str(tmp_path / "w.safetensors")),
                      seed=0, block_size=16)
    got = init_values(spec)
    assert all(torch.equal(got[k], trained[k]) for k in got)
    assert spec.record()["init"] == "pretrained"


def test_freeze_marks_parameters_and_rejects_a_pattern_that_matches_nothing(llama_dir):
    model = spec_of("model.kind=hf", f"model.path={llama_dir}", "model.freeze=model.embed_tokens.*").build()
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["model.embed_tokens.weight"]
    with pytest.raises(ModelError, match=r"model.freeze: model.embed\.\* matches no parameter"):
        spec_of("model.kind=hf", f"model.path={llama_dir}", "model.freeze=model.embed.*").build()


# ------------------------------------------------------------------------- pretrained


def test_pieces_read_by_range_equal_the_tensors_in_any_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(7, 5, generator=g), "b.weight": torch.randn(3, 300, generator=g),
               "c": torch.randn(11, generator=g)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        save_file({k: v.to(dtype) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
        w = SafetensorsWeights.find(str(tmp_path))
        w.resolve({k: tuple(v.shape) for k, v in tensors.items()})
        outs = {k: torch.full((v.numel(),), float("nan")) for k, v in tensors.items()}
        cuts = {"a.weight": (3, 30), "b.weight": (1, 899), "c": (0, 11)}
        w.fill_pieces([Piece(k, a, b, tuple(tensors[k].shape), outs[k][a:b]) for k, (a, b) in cuts.items()])
        for k, (a, b) in cuts.items():
            want = tensors[k].to(dtype).float().view(-1)[a:b]
            assert torch.equal(outs[k][a:b], want), (dtype, k)
            assert torch.isnan(outs[k][:a]).all() and torch.isnan(outs[k][b:]).all(), "nothing outside the piece"
        assert w.bytes_read <= sum(b - a for a, b in cuts.values()) * dtype.itemsize + 2 * 4096


def test_sharded_weights_with_an_index(tmp_path, llama_dir):
    import transformers as tf

    d = save_hf_model("llama", tmp_path / "sharded", dtype=torch.bfloat16, max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").is_file()
    spec = spec_of("model.kind=hf", f"model.path={d}")
    got = init_values(spec)
    plain = tf.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    for n, p in plain.named_parameters():
        assert torch.equal(got[n], p.detach()), n
    assert spec.record()["weights_dtype"] == "bfloat16"


def test_a_base_model_checkpoint_loads_through_the_prefix(tmp_path):
    """GPT-2 checkpoints are often saved from GPT2Model: names without `transformer.`."""
    import transformers as tf

    from tests.models import hf_config

    base = tf.GPT2Model(hf_config("gpt2"))
    base.save_pretrained(str(tmp_path))
    got = init_values(spec_of("model.kind=hf", f"model.path={tmp_path}"))
    assert torch.equal(got["transformer.wte.weight"], base.wte.weight.detach())


def test_weights_that_do_not_match_list_every_culprit(tmp_path, llama_dir):
    bad = {k: v for k, v in _load(llama_dir).items() if "layers.1.mlp" not in k}
    bad["model.norm.weight"] = torch.ones(7)
    bad["extra.bias"] = torch.zeros(2)
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError) as info:
        spec_of("model.kind=hf", f"model.path={tmp_path}").check(32)
    msg = str(info.value)
    assert "do not match the model" in msg
    assert "model.layers.1.mlp.down_proj.weight: missing from the weights" in msg
    assert "model.norm.weight: shape [7] in the weights, [32] in the model" in msg
    assert "extra.bias: in the weights, not in the model" in msg


def _load(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_bad_model_directories(tmp_path, llama_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"model.path: .*empty has no config.json"):
        spec_of("model.kind=hf", f"model.path={tmp_path / 'empty'}")
    with pytest.raises(ModelError, match=r"model.path: .*nowhere does not exist"):
        spec_of("model.kind=hf", f"model.path={tmp_path / 'nowhere'}")
    import transformers as tf

    vit = tmp_path / "vit"
    tf.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16).save_pretrained(vit)
    with pytest.raises(ModelError, match=r"holds a ViTConfig \(model_type 'vit'\), which transformers has no causal LM"):
        spec_of("model.kind=hf", f"model.path={vit}").build()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"transformers cannot read .*broken/config.json"):
        spec_of("model.kind=hf", f"model.path={broken}")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text((llama_dir / "config.json").read_text())
    (tmp_path / "junk" / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"xx")
    with pytest.raises(ModelError, match=r"junk/model.safetensors is not a safetensors file"):
        spec_of("model.kind=hf", f"model.path={tmp_path / 'junk'}").check(32)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((llama_dir / "config.json").read_text())
    assert spec_of("model.kind=hf", f"model.path={no_weights}").record()["init"] == "random"
    with pytest.raises(ModelError, match="no weights in .*no_weights"):
        spec_of("model.kind=hf", f"model.path={no_weights}", "model.init=pretrained").check(32)
    idx = tmp_path / "index"
    idx.mkdir()
    (idx / "config.json").write_text((llama_dir / "config.json").read_text())
    (idx / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(ModelError, match="lists model-1.safetensors, which is not there"):
        spec_of("model.kind=hf", f"model.path={idx}").check(32)


def test_sequence_and_vocabulary_checks(llama_dir):
    spec = spec_of("model.kind=hf", f"model.path={llama_dir}")
    with pytest.raises(ModelError, match=r"train.seq_len: 512 exceeds the model's 128 positions"):
        spec.check(512)
    with pytest.raises(ModelError, match=r"its vocabulary of 320 tokens is smaller than the dataset's \(1000\)"):
        spec.check(32, data_vocab=1000)


@pytest.mark.parametrize("factory,message", [
    ("tests.models", "is not of the form package.module:callable"),
    ("tests.nowhere:f", "cannot import tests.nowhere: ModuleNotFoundError"),
    ("tests.models:Nope", "tests.models has no attribute 'Nope'"),
    ("tests.models:VOCAB", "is a int, not a callable"),
    ("tests.models:not_a_module", "returned a str, not an nn.Module"),
])
def test_bad_factories(factory, message):
    with pytest.raises(ModelError, match=message):
        spec_of("model.kind=module", f"model.factory={factory}").build()


def test_a_forward_of_the_wrong_shape_is_named_before_the_cluster_starts():
    spec = spec_of("model.kind=module", "model.factory=tests.models:WrongShape")
    with pytest.raises(ModelError, match=r"the forward returned shape \[2, 320\] for input \[2, 8\]; expected "
                                         r"logits \[batch, time, vocab\]"):
        spec.check(32)


def test_the_first_micro_batch_checks_output_and_vocabulary():
    spec = spec_of("model.kind=module", "model.factory=tests.models:TinyLM", "model.kwargs.vocab=100")
    model = TinyLM(vocab=100)
    x = torch.randint(0, 300, (2, 8))
    with pytest.raises(ModelError, match=r"the forward failed on token ids up to \d+ \(IndexError: index out of "
                                         r"range in self\): is its vocabulary smaller than the data's\?"):
        spec.loss(model, MicroBatch(x, x), check=True)
    y = torch.randint(0, 300, (2, 8))
    with pytest.raises(ModelError, match=r"its vocabulary of 100 tokens is smaller than the data's: the batch "
                                         r"holds token id \d+"):
        spec.loss(model, MicroBatch(x % 100, y), check=True)


def test_model_config_keys_of_another_kind_are_refused():
    with pytest.raises(ConfigError, match=r"model.n_layer: only for model.kind=gpt"):
        load_config(None, ["model.kind=hf", "model.path=x", "model.n_layer=4"])
    with pytest.raises(ConfigError, match=r"model.path: model.kind=hf needs the model directory"):
        load_config(None, ["model.kind=hf"])
    from rayzero.jobs.plan import plan

    with pytest.raises(ConfigError, match=r"model.factory: model.kind=module needs"):
        plan(load_config(None, ["model.kind=module"]))
    cfg = load_config(None, ["model.kind=module", "model.factory=a:b", "model.kwargs.dim=64", "model.kwargs.tie=false"])
    assert cfg.model.kwargs == {"dim": 64, "tie": False}
    assert cfg.override("train.steps=3").model == cfg.model  # a dumped config validates again


def test_nn_module_registration_is_restored_after_a_failed_build():
    with pytest.raises(ModelError):
        spec_of("model.kind=module", "model.factory=tests.models:not_a_module").build()
    assert nn.Linear(2, 2).weight.device.type == "cpu"
