"""Pretrained weights through real gloo groups: loaded shard by shard and exported back bit for
bit; frozen parameters; an HF model's checkpoint resumed bitwise and resharded."""

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rayzero.checkpoint.manifest import open_checkpoint
from rayzero.checkpoint.tools import export_checkpoint
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist import ckpt_helpers
from tests.dist.pool import spawn
from tests.dist.reference import rel_error, train_reference
from tests.models import save_hf_model, save_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A Llama saved in bf16 across several files with an index, with a tokenizer and a
    generation config, as models come from the hub."""
    d = save_hf_model("llama-untied", tmp_path_factory.mktemp("bf16") / "llama", dtype=torch.bfloat16,
                      max_shard_size="30KB")
    save_tokenizer(d, ["def f(x):\n    return x + 1\n" * 20])
    assert len(list(d.glob("model-*.safetensors"))) > 1 and (d / "generation_config.json").is_file()
    return d


def _save_untouched(rank, world, cfg, data_path, port, out):
    """Set up (reading the weights), then checkpoint at step 0 without a single update."""
    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data_path)
    info = r.setup("127.0.0.1", port)
    ckpt = Checkpoints(cfg)
    r.plan = {"step": -1, "lr": 0.0, "checkpoint": {"uri": ckpt.root.child("step-000000").uri, "step": 0}}
    r._checkpoint(r.plan["checkpoint"])
    out[rank] = {"info": info, "uploads": r.finish_checkpoints()}
    r.close()


@pytest.mark.parametrize("strategy,world", [("optim_grads_params", 2), ("optim", 3)])
def test_load_then_export_gives_the_original_tensors_bit_for_bit(strategy, world, bf16_dir, small_dataset, tmp_path):
    cfg = load_config(None, [f"cluster.num_workers={world}", "model.kind=hf", f"model.path={bf16_dir}",
                             "train.seq_len=32", f"train.global_batch_size={2 * world}", "train.micro_batch_size=2",
                             f"sharding.strategy={strategy}", "sharding.shard_align=1",
                             f"checkpoint.dir={tmp_path / 'ckpt'}"])
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_save_untouched, args=(world, cfg, small_dataset, free_port(), out), nprocs=world)
        out = {r: out[r] for r in range(world)}
    ckpt = Checkpoints(cfg)
    ckpt.configure([out[r]["info"] for r in range(world)], mlflow_run_id=None)
    ckpt.collect(-1, [{"rank": r, "checkpointed": True, "loss_scale": None, "lr": 0.0, "uploads": []}
                      for r in range(world)])
    ckpt.add_uploads([u for r in range(world) for u in out[r]["uploads"]])
    assert ckpt.last_committed
    c = open_checkpoint(ckpt.last_committed)
    assert c.manifest["model_source"]["kind"] == "hf" and c.manifest["model_source"]["weights_dtype"] == "bfloat16"
    export = tmp_path / "export"
    export_checkpoint(c, str(export), "hf", max_shard_bytes=40_000)
    original, exported = {}, {}
    for f in bf16_dir.glob("*.safetensors"):
        original.update(load_file(str(f)))
    for f in export.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    assert exported.keys() == original.keys()
    for k, v in original.items():
        assert exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v), k
    assert len(list(export.glob("model-*.safetensors"))) > 1 and (export / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "generation_config.json"):
        assert (export / name).read_bytes() == (bf16_dir / name).read_bytes()
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    import transformers as tf

    tf.AutoModelForCausalLM.from_pretrained(str(export))  # loads without a missing or unexpected key
    # Each rank read its part of the weights, not the whole model.
    total = sum(v.numel() * 2 for v in original.values())
    reads = [out[r]["info"]["source_bytes_read"] for r in range(world)]
    assert sum(reads) < 1.3 * total and max(reads) < 1.6 * total / world, reads


FREEZE = "model.freeze=model.embed_tokens.*,model.layers.0.self_attn.*"


def _frozen_worker(rank, world, cfg, data_path, port, out):
    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data_path)
    info = r.setup("127.0.0.1", port)
    initial = r.full_state_dict()
    losses = []
    for k in range(6):
        res = r.iteration({"step": k, "lr": lr_at(k, 6, cfg.optim)})
        losses.append((res["loss_sum"], res["tokens"]))
    grads = {n for n, p in r.model.named_parameters() if p.grad is not None and not p.requires_grad}
    out[rank] = {"info": info, "memory": res["memory"], "losses": losses, "initial": initial,
                 "state": r.full_state_dict(), "frozen_grads": grads,
                 "optimizer_numel": r.strategy.optimizer.exp_avg.numel()}
    r.close()


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads", "optim_grads_params"])
def test_frozen_parameters_get_no_gradient_no_optimizer_state_and_do_not_move(strategy, small_dataset, tmp_path):
    d = save_hf_model("llama", tmp_path / "llama")
    world = 2
    cfg = load_config(None, [f"cluster.num_workers={world}", "model.kind=hf", f"model.path={d}", FREEZE,
                             "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
                             "train.steps=6", f"sharding.strategy={strategy}", "sharding.shard_align=1",
                             "optim.grad_clip=0.1", "optim.warmup_steps=2"])
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_frozen_worker, args=(world, cfg, small_dataset, free_port(), out), nprocs=world)
        out = {r: out[r] for r in range(world)}
    info = out[0]["info"]
    frozen = info["frozen"]
    assert "model.embed_tokens.weight" in frozen and "model.layers.0.self_attn.q_proj.weight" in frozen
    frozen_numel = info["num_params"] - info["trainable_params"]
    assert frozen_numel > 0.3 * info["num_params"]
    for r in range(world):
        assert out[r]["frozen_grads"] == set()
    # The tied head is the embedding: frozen with it; the frozen weights end where they began.
    state, initial = out[0]["state"], out[0]["initial"]
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert torch.equal(state[name], initial[name]), name
    assert not torch.equal(state["model.layers.1.mlp.up_proj.weight"], initial["model.layers.1.mlp.up_proj.weight"])
    # The ledger: frozen parameters hold their compute copy only (sharded under ZeRO-3).
    mem = out[0]["memory"]
    shards = world if strategy == "optim_grads_params" else 1
    assert mem["frozen_params"] == pytest.approx(4 * frozen_numel / shards, rel=0.02)
    opt_d = world if strategy != "no_shard" else 1
    assert mem["optimizer"] == pytest.approx(8 * info["trainable_params"] / opt_d, rel=0.02)
    assert out[0]["optimizer_numel"] * 8 == mem["optimizer"]
    # And the training equals plain torch with those parameters frozen.
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(str(d))
    for n, p in ref.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    ref_state, ref_losses = train_reference(ref, cfg, small_dataset, 6)
    for name, v in ref_state.items():
        assert rel_error(state[name], v) <= 1e-5, name
    losses = [sum(out[r]["losses"][k][0] for r in range(world)) / sum(out[r]["losses"][k][1] for r in range(world))
              for k in range(6)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_an_hf_model_resumes_bitwise_and_reshards(small_dataset, tmp_path):
    """Qwen2 with a frozen MLP: 20 steps straight against 10, a checkpoint, and 10 more after a
    resume at the same layout (bitwise) and at another world size and strategy (within 1e-5).
    The checkpoint holds no frozen element: a resume takes those from the weights again."""
    d = save_hf_model("qwen2", tmp_path / "qwen2")

    def config(world, strategy, root):
        return load_config(None, [f"cluster.num_workers={world}", "model.kind=hf", f"model.path={d}",
                                  "model.freeze=model.layers.1.mlp.*", "train.seq_len=32",
                                  "train.global_batch_size=12", "train.micro_batch_size=1", "train.steps=20",
                                  "train.seed=3", f"sharding.strategy={strategy}", "sharding.bucket_numel=3000",
                                  "sharding.shard_align=1", "optim.lr=1e-3", "optim.warmup_steps=2",
                                  f"checkpoint.dir={root}", "checkpoint.every_steps=0"])

    straight = ckpt_helpers.run(config(2, "optim_grads_params", tmp_path / "a"), small_dataset, 0, 20)
    first = ckpt_helpers.run(config(2, "optim_grads_params", tmp_path / "b"), small_dataset, 0, 10, save_at=10)
    c = open_checkpoint(first["committed"])
    m = c.manifest
    assert m["frozen"] == ["model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                           "model.layers.1.mlp.up_proj.weight"]
    saved = sum(e - s for shard in m["shards"] for s, e in shard["pieces"])
    trainable = first["infos"][0]["trainable_params"]
    assert trainable <= saved < trainable * 1.01, "the shards hold the trainable parameters only"
    same = ckpt_helpers.run(config(2, "optim_grads_params", tmp_path / "b"), small_dataset, 10, 20,
                            resume=(c.uri, m))
    assert same["losses"] == straight["losses"][10:]
    for k, v in straight["state"].items():
        assert torch.equal(same["state"][k], v), k
    other = ckpt_helpers.run(config(3, "optim", tmp_path / "b"), small_dataset, 10, 20, resume=(c.uri, m))
    assert other["losses"] == pytest.approx(straight["losses"][10:], rel=1e-5)
    for k, v in straight["state"].items():
        assert rel_error(other["state"][k], v) <= 1e-5, k
