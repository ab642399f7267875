"""A user's mistake ends before training with one clear message and no traceback.

Each of these ends before any cluster is touched, so `rayzero`'s `main` runs in this process;
one case goes through the real entry point, a process of its own, for the exit code and the
message on stderr as a shell sees them."""

import json

import pytest

from rayzero.data.tokens import prepare
from tests.conftest import cli_in_process, without_startup
from tests.e2e.conftest import run_cli
from tests.models import save_hf_model


@pytest.mark.parametrize("args, expected", [
    (["train.stepz=3"], "train.stepz: unknown key; did you mean 'steps'?"),
    (["train.steps=many"], "train.steps: Input should be a valid integer"),
    (["sharding.strategy=zero9"], "sharding.strategy: Input should be 'no_shard', 'optim', 'optim_grads' or 'optim_grads_params'"),
    (["train.global_batch_size=10"], "train.global_batch_size: 10 is not divisible"),
    (["data.path=DATA", "sharding.strategy=optim_grads_params", "sharding.fsdp_units=Blok"],
     "sharding.fsdp_units: no module of GPT has class Blok; its module classes are"),
    (["cluster.num_workers=4", "sharding.dp_outer=3"], "sharding.dp_outer: 3 does not divide cluster.num_workers (4)"),
    (["sharding.param_dtype=fp16", "sharding.loss_scale=none"], "fp16 parameters need loss scaling"),
    # tensor parallelism: the mesh, then the model's shapes, before anything starts
    (["cluster.num_workers=4", "parallel.tp=3"], "parallel.tp: 3 does not divide cluster.num_workers (4)"),
    (["cluster.num_workers=4", "sharding.dp_outer=2", "parallel.tp=4", "sharding.strategy=optim_grads_params"],
     "sharding.dp_outer x parallel.tp: 2 x 4 = 8 does not divide cluster.num_workers (4)"),
    (["parallel.sequence_parallel=true"],
     "parallel.sequence_parallel: splits the sequence over tensor-parallel ranks; set parallel.tp > 1"),
    (["cluster.num_workers=2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=33"],
     "train.seq_len: 33 is not divisible by parallel.tp (2), over which parallel.sequence_parallel splits"),
    (["data.path=DATA", "cluster.num_workers=8", "cluster.cpus_per_worker=0.25", "parallel.tp=8",
      "train.global_batch_size=8"], "blocks.0.attn.qkv: parallel.tp=8 does not divide its 4 attention heads"),
    # context parallelism: the split, the heads ulysses needs, the world, what it does not reach yet
    (["cluster.num_workers=2", "parallel.cp=2", "train.seq_len=30"],
     "train.seq_len: 30 does not split into 2 x parallel.cp = 4 equal chunks (each cp rank holds two, for even causal "
     "work); e.g. 28, 32, 36 would"),
    (["data.path=DATA", "cluster.num_workers=2", "parallel.cp=2", "parallel.cp_mode=ulysses", "model.n_head=3",
      "model.n_embd=96"], "parallel.cp_mode: ulysses splits the attention heads over parallel.cp (2), and 3 heads / 3 "
                          "key/value heads do not divide by it; use parallel.cp_mode=ring"),
    (["cluster.num_workers=2", "parallel.cp=4"], "parallel.cp: 4 does not divide cluster.num_workers (2)"),
    (["data.path=DATA", "cluster.num_workers=2", "parallel.cp=2", "model.kind=module", "model.factory=tests.models:Scaled"],
     "parallel.cp: model.kind=module (Scaled) does not say how its attention runs across a split sequence; give the "
     "module a `context_parallel(attend, positions)` method"),
    # expert parallelism: a dense model, the data-parallel ranks, the capacity, a module without the hook
    (["data.path=DATA", "cluster.num_workers=2", "parallel.ep=2"],
     "parallel.ep: model.kind=gpt is dense: expert parallelism splits a mixture of experts' experts"),
    (["cluster.num_workers=2", "parallel.ep=2", "parallel.cp=2"],
     "parallel.ep x parallel.cp: 2 x 2 = 4 does not divide cluster.num_workers (2)"),
    (["moe.capacity_factor=0"], "moe.capacity_factor: Input should be greater than 0"),
    (["data.path=DATA", "moe.router_z_loss=0.001"], "moe.router_z_loss: model.kind=gpt has no router load-balancing "
     "loss for the z-loss to join"),
    (["data.path=DATA", "cluster.num_workers=2", "parallel.ep=2", "model.kind=module",
      "model.factory=tests.models:TinyLM"], "parallel.ep: model.kind=module (TinyLM) does not say how its experts split"),
    (["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
    (["data.path=/nonexistent/data"], "no dataset at /nonexistent/data"),
    (["cluster.address=127.0.0.1:1", "data.path=DATA"], "cluster.address: cannot connect"),
    (["data.path=DATA", "train.save_final=nosuch://bucket/w.safetensors"], "train.save_final: 'nosuch://bucket/w.safetensors' cannot be written"),
    (["data.path=DATA", "train.save_final=/proc/version/w.safetensors"], "train.save_final: '/proc/version/w.safetensors' cannot be written"),
    (["train.early_stopping_patience=2"], "train.early_stopping_patience: needs validation data (data.val_fraction"),
    (["checkpoint.keep_best=val_loss"], "checkpoint.keep_best: val_loss needs validation data"),
    (["checkpoint.keep_best=val_loss", "data.val_fraction=0.1", "checkpoint.dir="], "checkpoint.keep_best: needs checkpoints"),
    (["checkpoint.keep_best=loss"], "checkpoint.keep_best: Input should be '' or 'val_loss'"),
    (["optim.schedule=step"], "optim.schedule: Input should be 'cosine', 'linear', 'constant' or 'wsd'"),
    (["optim.decay_fraction=0"], "optim.decay_fraction: Input should be greater than 0"),
    (["optim.schedule_total=longer"], "optim.schedule_total: Input should be 'original' or 'new'"),
    (["model.activation_checkpointing=every:0"],
     "model.activation_checkpointing: expected none, full, every:N (N a whole number >= 1) or selective"),
    (["model.activation_checkpointing=every:two"], "model.activation_checkpointing: expected none, full, every:N"),
    (["data.path=DATA", "model.activation_checkpointing=full", "model.recompute_blocks=Blok"],
     "model.recompute_blocks: no module of GPT has class Blok; its module classes are Block, CausalSelfAttention"),
    # preference tuning: a pair split across micro-batches, settings that would do nothing, the wrong data
    (["train.objective=dpo", "train.micro_batch_size=3", "train.global_batch_size=12"],
     "train.micro_batch_size: 3 would split a preference pair"),
    (["train.objective=dpo", "dpo.loss=orpo", "dpo.precompute_ref=true"],
     "dpo.precompute_ref: dpo.loss=orpo has no reference model to precompute"),
    (["train.objective=dpo", "dpo.label_smoothing=0.1"],
     "dpo.label_smoothing: 0.1 would do nothing to dpo.loss=sigmoid (as in TRL, only robust DPO takes it)"),
    (["data.path=DATA", "train.objective=dpo"], "train.objective=dpo learns from preference pairs, but data.path: "),
    # a local Ray this machine cannot hold: refused at once, not after the placement wait
    (["data.path=DATA", "cluster.num_workers=4", "cluster.cpus_per_worker=64"],
     "cluster.num_workers: cluster.num_workers=4 x 64 CPU (cluster.cpus_per_worker) = 256 CPUs, but this machine's "
     "local Ray has"),
])
def test_bad_input_is_one_clear_message(tmp_path, small_dataset, capsys, monkeypatch, args, expected):
    args = [a.replace("DATA", small_dataset) for a in args]
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", *args)
    assert code == 2, err
    err = without_startup(err)
    assert expected in err and err.startswith("rayzero: error: ")
    assert not (tmp_path / "runs").exists() or "cluster.address" in expected


def test_the_entry_point_exits_2_with_the_message_on_stderr(tmp_path):
    r = run_cli("train", "train.stepz=3", cwd=tmp_path, timeout=180)
    assert r.returncode == 2 and r.stdout == ""
    first, second = r.stderr.strip().splitlines()
    assert first == "rayzero: error: invalid config:"
    assert second.startswith("  train.stepz: unknown key; did you mean 'steps'? (train accepts: steps, ")


def test_corpus_too_small_for_one_global_batch(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("tiny corpus " * 20)
    prepare(tmp_path / "a.txt", str(tmp_path / "d"))
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", f"data.path={tmp_path / 'd'}")
    assert code == 2
    assert "data.path" in err and "fewer than one global batch" in err


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Model directories a user might get wrong: none at all, weights of another shape, a
    vocabulary smaller than the data's; and a module file with a forward of the wrong shape."""
    from safetensors.torch import load_file, save_file

    from tests.models import hf_config, save_hf_model

    root = tmp_path_factory.mktemp("models")
    (root / "empty").mkdir()
    good = save_hf_model("llama", root / "good")
    mismatch = save_hf_model("llama", root / "mismatch")
    weights = load_file(str(mismatch / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:10]
    del weights["model.norm.weight"]
    save_file(weights, str(mismatch / "model.safetensors"))
    save_hf_model("llama", root / "small_vocab", vocab_size=200)
    save_hf_model("mixtral", root / "mixtral", num_hidden_layers=1)
    import transformers as tf

    tf.LlamaConfig(**{**hf_config("llama").to_dict(), "hidden_size": 48, "num_attention_heads": 6,
                      "num_key_value_heads": 4, "intermediate_size": 63}).save_pretrained(root / "tp_odd")
    tf.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                  vocab_size=320).save_pretrained(root / "bert")
    tf.T5Config(d_model=16, d_ff=16, num_layers=1, num_heads=2, vocab_size=320).save_pretrained(root / "t5")
    # attention that cp does not split yet: GPT-OSS's sinks and sliding window, Mistral's window
    tf.GptOssConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=320,
                    sliding_window=8, max_position_embeddings=128).save_pretrained(root / "gpt_oss")
    save_hf_model("mistral", root / "mistral", sliding_window=16)
    (root / "shapes.py").write_text(
        "import torch.nn as nn\n\n\nclass LastOnly(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.emb = nn.Embedding(320, 8)\n        self.head = nn.Linear(8, 320)\n\n"
        "    def forward(self, idx):\n        return self.head(self.emb(idx))[:, -1]\n")
    return {"root": root, "good": good}


@pytest.mark.parametrize("args, expected", [
    (["model.kind=hf", "model.path=ROOT/empty"], "model.path: ROOT/empty has no config.json"),
    (["model.kind=hf", "model.path=ROOT/nowhere"], "model.path: ROOT/nowhere does not exist"),
    (["model.kind=hf", "model.path=ROOT/shapes.py"], "model.path: ROOT/shapes.py is a file, not a directory"),
    (["model.kind=hf", "model.path=ROOT/mismatch"],
     "model.layers.0.mlp.up_proj.weight: shape [10, 32] in the weights, [64, 32] in the model"),
    (["model.kind=hf", "model.path=ROOT/mismatch"], "model.norm.weight: missing from the weights"),
    (["model.kind=hf", "model.path=ROOT/small_vocab"], "its vocabulary of 200 tokens is smaller than the dataset's (257)"),
    (["model.kind=hf", "model.path=ROOT/good", "train.seq_len=1024"], "train.seq_len: 1024 exceeds the model's 128 positions"),
    (["model.kind=module", "model.factory=nowhere:Model"], "model.factory: cannot import nowhere: ModuleNotFoundError"),
    (["model.kind=module", "model.factory=shapes:LastOnly"],
     "the forward returned shape [2, 320] for input [2, 8]; expected logits [batch, time, vocab]"),
    (["model.kind=hf", "model.path=ROOT/good", "model.n_layer=4"], "model.n_layer: only for model.kind=gpt"),
    (["model.kind=module", "model.factory=tests.models:Scaled", "model.activation_checkpointing=full"],
     "model.recompute_blocks: Scaled has no list of layers of one class to recompute; name its block class(es)"),
    (["model.kind=hf", "model.path=ROOT/bert"], "model.path: ROOT/bert holds an encoder (BertConfig, model_type 'bert') "
     "whose attention sees the whole sequence, so next-token training would learn nothing usable; rayzero trains "
     "decoder-only causal LMs"),
    (["model.kind=hf", "model.path=ROOT/t5"], "model.path: ROOT/t5 holds an encoder-decoder model (T5Config, model_type "
     "'t5'); rayzero trains decoder-only causal LMs"),
    # LoRA
    (["model.kind=hf", "model.path=ROOT/good", "model.lora.target_modules=q_proj,qproj"],
     "model.lora.target_modules: qproj matches no module; the linear layers are down_proj, gate_proj, k_proj, "
     "lm_head, o_proj, q_proj, up_proj, v_proj"),
    (["model.kind=hf", "model.path=ROOT/good", "model.lora.target_modules=embed_tokens"],
     "model.lora.target_modules: embed_tokens matches model.embed_tokens (Embedding); LoRA here adapts linear layers"),
    (["model.kind=hf", "model.path=ROOT/good", "model.lora.r=8", "model.lora.modules_to_save=score"],
     "model.lora.modules_to_save: score matches no module with parameters; they are down_proj, embed_tokens"),
    (["model.kind=hf", "model.path=ROOT/good", "model.lora.r=0"], "model.lora.r: the rank must be a positive whole number, got 0"),
    (["model.kind=hf", "model.path=ROOT/good", "model.lora.alpha=0"], "model.lora.alpha: must be positive, got 0"),
    (["model.kind=hf", "model.path=ROOT/good", "model.lora.rank=8"], "model.lora.rank: unknown key (model.lora accepts: r, alpha, dropout, target_modules, modules_to_save)"),
    (["model.kind=hf", "model.path=ROOT/good", "train.save_format=peft"],
     "train.save_format: peft writes LoRA adapters, and this run has none"),
    (["model.lora.r=8"], "model.lora.target_modules: PEFT has no default for GPT; name the layers to adapt, e.g. "
     "model.lora.target_modules=... from its linear layers: fc, lm_head, proj, qkv"),
    (["model.lora.target_modules=lm_head"],
     "model.lora.target_modules: lm_head.weight is tied to wte.weight, so merging an adapter into it would change both"),
    (["model.kind=module", "model.factory=tests.models:TinyLM", "model.lora.target_modules=emb"],
     "model.lora.target_modules: emb matches emb (Embedding); LoRA here adapts linear layers: "),
    (["model.kind=hf", "model.path=ROOT/good", "model.lora.r=8", "model.freeze=lm_head.*"],
     "model.freeze: model.lora already freezes every base weight"),
    # tensor parallelism (6 heads, 4 key/value heads, an MLP 63 wide)
    (["model.kind=hf", "model.path=ROOT/good", "cluster.num_workers=8", "cluster.cpus_per_worker=0.25", "parallel.tp=8",
      "train.global_batch_size=8"], "model.layers.0.self_attn.q_proj: parallel.tp=8 does not divide its 4 attention heads"),
    (["model.kind=hf", "model.path=ROOT/tp_odd", "cluster.num_workers=3", "parallel.tp=3", "cluster.cpus_per_worker=0.5"],
     "model.layers.0.self_attn.k_proj: parallel.tp=3 neither divides its 4 key/value heads nor is a multiple of them"),
    (["model.kind=hf", "model.path=ROOT/tp_odd", "cluster.num_workers=2", "parallel.tp=2"],
     "model.layers.0.mlp.gate_proj: parallel.tp=2 does not divide its 63 output features"),
    (["model.kind=module", "model.factory=tests.models:TinyLM", "cluster.num_workers=2", "parallel.tp=2"],
     "parallel.tp: model.kind=module has no tensor-parallel plan"),
    # expert parallelism: 4 experts over 3 ranks; a dense HF model
    (["model.kind=hf", "model.path=ROOT/mixtral", "cluster.num_workers=3", "cluster.cpus_per_worker=0.5",
      "parallel.ep=3", "train.global_batch_size=12"],
     "parallel.ep: 3 does not divide the 4 experts of ROOT/mixtral; ep must divide 4"),
    (["model.kind=hf", "model.path=ROOT/good", "cluster.num_workers=2", "parallel.ep=2"],
     "parallel.ep: ROOT/good has no experts to split"),
    # context parallelism: attention the split does not do yet, refused by name (it trained 0 steps in minutes)
    (["model.kind=hf", "model.path=ROOT/gpt_oss", "cluster.num_workers=2", "parallel.cp=2"],
     "parallel.cp: GptOssForCausalLM's attention has sinks (a learned logit per head that every query also attends "
     "to), which attention across the context-parallel split does not do yet; set parallel.cp=1"),
    (["model.kind=hf", "model.path=ROOT/mistral", "cluster.num_workers=2", "parallel.cp=2"],
     "parallel.cp: MistralForCausalLM's layers attend within a sliding window of 16 tokens, which attention across "
     "the context-parallel split does not do yet; set parallel.cp=1, or train.seq_len=16 or less"),
])
def test_a_bad_model_is_one_clear_message(model_dirs, small_dataset, capsys, monkeypatch, args, expected):
    root = str(model_dirs["root"])
    args = [a.replace("ROOT", root) for a in args]
    code, _, err = cli_in_process(capsys, monkeypatch, model_dirs["root"], "train", "train.seq_len=32", *args,
                                  f"data.path={small_dataset}")
    assert code == 2, err
    err = without_startup(err)
    assert expected.replace("ROOT", root) in err and err.startswith("rayzero: error: ")
    assert not (model_dirs["root"] / "runs").exists()


def test_a_module_that_cannot_keep_packed_examples_apart_is_refused_for_instruction_data(tmp_path, capsys,
                                                                                         monkeypatch):
    (tmp_path / "ex.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n"
                                               for i in range(20)))
    prepare(tmp_path / "ex.jsonl", str(tmp_path / "ex"), instructions=True)
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "model.kind=module",
                                  "model.factory=tests.models:Scaled", f"data.path={tmp_path / 'ex'}", "train.seq_len=32")
    assert code == 2, err
    err = without_startup(err)
    assert err.startswith("rayzero: error: model.factory=tests.models:Scaled: instruction data packs several examples "
                          "into each row, and Scaled.forward takes no `document_ids` to keep them apart; give it "
                          "`position_ids` and `document_ids` keywords"), err


def test_save_final_will_not_replace_another_models_export(tmp_path, small_dataset, capsys, monkeypatch):
    """An export of another model where `train.save_final` points is refused before training,
    naming both, unless `train.overwrite_final=true`."""
    import json

    import ray
    import torch

    from rayzero.checkpoint.export import MODEL_KEY, save_safetensors

    final = tmp_path / "final.safetensors"
    other = {"kind": "hf", "source": "/models/other", "config_sha256": "0123456789abcdef"}
    save_safetensors({"w": torch.zeros(1)}, str(final), {MODEL_KEY: json.dumps(other)})
    args = ["train", f"data.path={small_dataset}", f"train.save_final={final}", "train.steps=1"]
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, *args)
    assert code == 2 and not ray.is_initialized()
    err = without_startup(err)
    assert err.startswith(f"rayzero: error: train.save_final: {final}: it already holds an export of hf model "
                          "/models/other (config 0123456789abcdef), and this run trains gpt model (no source)")
    assert "set train.overwrite_final=true to replace it" in err and not (tmp_path / "runs").exists()


def test_the_vocabulary_split_is_refused_or_left_whole_before_anything_starts(tmp_path, capsys, monkeypatch):
    """`parallel.tp` beyond the vocabulary the embedding and head would be split over: one
    message. A head that cannot be split (LoRA adapters on it): one note saying why and what is
    done instead, and the plan goes on."""
    tiny = save_hf_model("llama", tmp_path / "three", vocab_size=3)
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", "model.kind=hf",
                                  f"model.path={tiny}", "cluster.num_workers=4", "cluster.cpus_per_worker=0.5",
                                  "parallel.tp=4", "train.seq_len=32", "train.global_batch_size=4")
    assert code == 2 and err.startswith("rayzero: error: ") and len(err.strip().splitlines()) == 1, err
    assert "parallel.tp=4 exceeds the vocabulary (3 tokens) that the embedding and head are split over; use a " \
           "smaller parallel.tp, or parallel.vocab_parallel=false" in err
    untied = save_hf_model("llama-untied", tmp_path / "untied")
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", "model.kind=hf",
                                    f"model.path={untied}", "cluster.num_workers=2", "parallel.tp=2", "model.lora.r=8",
                                    "model.lora.target_modules=q_proj,lm_head")
    assert code == 0, err
    assert ("note: parallel.vocab_parallel: LlamaForCausalLM's vocabulary is not split over the 2 tensor-parallel "
            "ranks, as its output head carries LoRA adapters (model.lora.target_modules names it); its embedding and "
            "head stay whole on every TP rank, with the full logits on each") in out
    code, out, _ = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", "model.kind=hf",
                                  f"model.path={untied}", "cluster.num_workers=2", "parallel.tp=2")
    assert code == 0 and "vocabulary parallel: embedding, head and logits split over the tp ranks" in out
    assert "note:" not in out
