"""Checkpoints in transformers' own layout where it differs from the model's: GPT-NeoX (its head
renamed) and two mixtures of experts (Mixtral, Qwen2-MoE: one tensor per expert on disk, one
fused parameter per layer in the model), saved by `save_pretrained`. Loaded shard by shard
under ZeRO-3 (the first loss is transformers' own), exported back bit for bit, trained (an
export loads into transformers and gives rayzero's logits), and the mixtures trained with their
router loss by every strategy exactly as a plain single-process torch run."""

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file

from rayzero.checkpoint.export import save_final
from rayzero.checkpoint.manifest import open_checkpoint
from rayzero.checkpoint.tools import export_checkpoint
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.data.microbatch import MicroBatch
from rayzero.workers.assembly import make_spec
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist.pool import spawn
from tests.dist.reference import global_rows
from tests.models import save_hf_model

pytestmark = pytest.mark.slow

ARCHS = ["gpt_neox", "mixtral", "qwen2_moe"]
STEPS = 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("converted")
    return {arch: str(save_hf_model(arch, root / arch, seed=i)) for i, arch in enumerate(ARCHS)}


def _load_save_train(rank, world, cfg, data_path, port, probe, out):
    """Set up under ZeRO-3 (reading the weights), checkpoint before any update, train a few
    steps, then the model's logits on `probe` and the whole weights."""
    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data_path)
    info = r.setup("127.0.0.1", port)
    ckpt = Checkpoints(cfg)
    r.plan = {"step": -1, "lr": 0.0, "checkpoint": {"uri": ckpt.root.child("step-000000").uri, "step": 0}}
    r._checkpoint(r.plan["checkpoint"])
    uploads = r.finish_checkpoints()
    steps = [r.iteration({"step": k, "lr": lr_at(k, STEPS, cfg.optim)}) for k in range(STEPS)]
    with torch.no_grad():
        r.model.eval()
        logits = r.spec.logits(r.model, MicroBatch(probe, probe)).logits.clone()
        r.strategy.after_forward_only()
    state = r.full_state_dict()
    out[rank] = {"info": info, "uploads": uploads, "steps": steps, "logits": logits,
                 **({"state": state} if rank == 0 else {})}
    r.close()


def commit_untouched(cfg, out: dict, world: int):
    """The step-0 checkpoint the ranks uploaded, committed as the controller does."""
    ckpt = Checkpoints(cfg)
    ckpt.configure([out[r]["info"] for r in range(world)], mlflow_run_id=None)
    ckpt.collect(-1, [{"rank": r, "checkpointed": True, "loss_scale": None, "lr": 0.0, "uploads": []}
                      for r in range(world)])
    ckpt.add_uploads([u for r in range(world) for u in out[r]["uploads"]])
    return open_checkpoint(ckpt.last_committed)


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_by_range_exported_bit_for_bit_and_trained(arch, dirs, small_dataset, tmp_path):
    import transformers as tf

    world = 2
    cfg = load_config(None, [f"cluster.num_workers={world}", "model.kind=hf", f"model.path={dirs[arch]}",
                             "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2",
                             "sharding.strategy=optim_grads_params", "sharding.shard_align=1", "optim.warmup_steps=1",
                             f"checkpoint.dir={tmp_path / 'ckpt'}"])
    probe = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(0))
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_load_save_train, args=(world, cfg, small_dataset, free_port(), probe, out), nprocs=world)
        out = {r: out[r] for r in range(world)}

    # The first loss is transformers' own on the same window (ranks' sums / the global count).
    theirs = tf.AutoModelForCausalLM.from_pretrained(dirs[arch], dtype=torch.float32)
    rows = global_rows(cfg, small_dataset, 0)
    with torch.no_grad():
        own = F.cross_entropy(theirs(input_ids=rows[:, :-1]).logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    first = sum(out[r]["steps"][0]["loss_sum"] for r in range(world)) / sum(out[r]["steps"][0]["tokens"]
                                                                           for r in range(world))
    assert first == pytest.approx(own, rel=1e-5)
    if arch != "gpt_neox":
        assert out[0]["steps"][0]["aux_loss_sum"] > 0, "the router loss is reported"

    # Each rank read about its shard of the weights, not the whole model.
    files = load_file(f"{dirs[arch]}/model.safetensors")
    full = sum(v.numel() * v.element_size() for v in files.values())
    for r in range(world):
        assert out[r]["info"]["source_bytes_read"] < 0.6 * full, (r, out[r]["info"]["source_bytes_read"], full)

    # Loaded, then exported with no update: transformers' own files, names and tensors, bit for bit.
    export = tmp_path / "untouched"
    export_checkpoint(commit_untouched(cfg, out, world), str(export), "hf")
    exported = load_file(str(export / "model.safetensors"))
    assert exported.keys() == files.keys()
    assert all(torch.equal(exported[k], v) for k, v in files.items()), [k for k, v in files.items()
                                                                       if not torch.equal(exported[k], v)]

    # Trained, then exported as the run's final weights: transformers loads it and computes the
    # logits rayzero's sharded model computed.
    trained = tmp_path / "trained"
    save_final(make_spec(cfg), out[0]["state"], str(trained), "hf", {})
    again = tf.AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(again(input_ids=probe).logits, out[0]["logits"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(again(input_ids=probe).logits, theirs(input_ids=probe).logits), "it trained"


