"""Checks only a GPU can make: NCCL process groups, every strategy and bf16 on CUDA, and
device memory against the ledger (skipped on CPU).

Run them all with `python benchmarks/gpu_checks.py`.
"""

import gc

import pytest
import torch

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.sharding.memory import formula_bytes_per_param
from rayzero.workers.rank import Rank
from tests.conftest import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_rank_trains_on_cuda_over_nccl(strategy, dtype, small_dataset):
    cfg = load_config(None, ["cluster.num_workers=1", "cluster.use_gpu=true", f"sharding.strategy={strategy}",
                             f"sharding.param_dtype={dtype}", "train.steps=20", "optim.warmup_steps=2"])
    rank = Rank(cfg, 0, 1, small_dataset)
    info = rank.setup("127.0.0.1", free_port())
    assert info["backend"] == "nccl" and info["device"].startswith("cuda")
    losses = []
    for step in range(cfg.train.steps):
        out = rank.iteration({"step": step, "lr": lr_at(step, cfg.train.steps, cfg.optim)})
        losses.append(out["loss_sum"] / out["tokens"])
    assert all(m.is_cuda for m in rank.strategy.main_params)
    assert all(m.dtype == torch.float32 for m in rank.strategy.main_params)
    assert losses[-1] < losses[0] - 0.5
    rank.close()


@pytest.mark.parametrize("dtype, pbytes", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_device_memory_at_rest_is_the_ledger(strategy, dtype, pbytes, small_dataset):
    """What the rank asks the CUDA allocator for while it builds its model state, and still
    holds, is the ledger (plus a few scalars); the ledger is the formula (d = 1) up to padding;
    `close()` gives it all back. The allocator holds a little more than it was asked for (it
    rounds large blocks up to 2 MiB and keeps a remainder under 1 MiB unsplit): reported, not
    counted against the ledger."""
    a = torch.ones(64, 64, device="cuda")
    for dt in (torch.float32, torch.bfloat16):  # cuBLAS's workspaces: made by a process's first products, kept
        torch.mm(a.to(dt), a.to(dt))
    del a
    gc.collect()
    torch.cuda.empty_cache()
    before, live = torch.cuda.memory_allocated(), _live_blocks()
    cfg = load_config(None, ["cluster.num_workers=1", "cluster.use_gpu=true", "model.preset=small",
                             f"sharding.strategy={strategy}", f"sharding.param_dtype={dtype}"])
    rank = Rank(cfg, 0, 1, small_dataset)
    info = rank.setup("127.0.0.1", free_port())
    new = [b for b in _live_blocks().values() if b["address"] not in live]
    asked = sum(b["requested_size"] for b in new)
    held = torch.cuda.memory_allocated() - before
    ledger = info["memory"]["total"]
    assert ledger <= asked <= ledger + 4096, _blocks(new, ledger, asked, held)
    formula = formula_bytes_per_param(strategy, 1, param_bytes=pbytes)
    assert info["memory"]["total"] / info["num_params"] == pytest.approx(formula, rel=0.02)
    rank.close()
    assert torch.cuda.memory_allocated() == before, "close() gives the allocator back all the rank held"


def _live_blocks() -> dict[int, dict]:
    return {b["address"]: b for seg in torch.cuda.memory._snapshot()["segments"] for b in seg["blocks"]
            if b["state"] == "active_allocated"}


def _blocks(new: list[dict], ledger: int, asked: int, held: int) -> str:
    """Each allocation the setup left, and the tensor that owns it (if Python sees one)."""
    owned = {t.untyped_storage().data_ptr(): f"{tuple(t.shape)} {t.dtype}" for t in gc.get_objects()
             if isinstance(t, torch.Tensor) and t.is_cuda}
    rows = [f"asked {asked} bytes, ledger {ledger} ({asked - ledger:+d}), held {held}"]
    rows += [f"  {b['requested_size']} (block {b['size']}): {owned.get(b['address'], 'no tensor')}" for b in new]
    return "\n".join(rows[:60])


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_an_hf_llama_loads_its_weights_onto_the_gpu_and_trains(strategy, small_dataset, tmp_path):
    """Pretrained weights read by range straight into CUDA buckets; bf16 compute: the first
    loss is the HF model's own (within bf16's rounding) and training lowers it."""
    import transformers as tf

    from tests.dist.reference import global_rows
    from tests.models import save_hf_model

    d = save_hf_model("llama", tmp_path / "llama")
    cfg = load_config(None, ["cluster.num_workers=1", "cluster.use_gpu=true", "model.kind=hf", f"model.path={d}",
                             f"sharding.strategy={strategy}", "sharding.param_dtype=bf16", "train.seq_len=64",
                             "train.steps=20", "optim.warmup_steps=2", "optim.lr=3e-3"])
    rank = Rank(cfg, 0, 1, small_dataset)
    info = rank.setup("127.0.0.1", free_port())
    assert info["backend"] == "nccl" and info["model"]["init"] == "pretrained"
    losses = []
    for step in range(cfg.train.steps):
        out = rank.iteration({"step": step, "lr": lr_at(step, cfg.train.steps, cfg.optim)})
        losses.append(out["loss_sum"] / out["tokens"])
    rank.close()
    rows = global_rows(cfg, small_dataset, 0).cuda()
    model = tf.AutoModelForCausalLM.from_pretrained(str(d)).cuda()
    with torch.no_grad():
        own = torch.nn.functional.cross_entropy(model(input_ids=rows[:, :-1]).logits.flatten(0, 1),
                                                rows[:, 1:].flatten()).item()
    assert losses[0] == pytest.approx(own, rel=2e-2)
    assert losses[-1] < losses[0] - 0.5


def test_the_rank_reports_its_device_and_the_summary_its_mfu(small_dataset):
    """On a GPU whose peak is in the table the throughput comes with MFU: the rank names its
    device and the model's FLOPs per token; MFU is achieved model FLOP/s over that peak."""
    from rayzero.cluster.throughput import peak_flops, throughput

    cfg = load_config(None, ["cluster.num_workers=1", "cluster.use_gpu=true", "sharding.param_dtype=bf16"])
    rank = Rank(cfg, 0, 1, small_dataset)
    info = rank.setup("127.0.0.1", free_port())
    assert info["device_name"] == torch.cuda.get_device_name()
    assert info["flops_per_token"] > 6 * info["num_params"]
    rank.close()
    rate = throughput(50_000.0, 1, info["flops_per_token"], info["device_name"])
    if peak_flops(info["device_name"]) is None:
        pytest.skip(f"{info['device_name']}: no dense bf16 peak known")
    assert 0 < rate["mfu"] < 1


def test_lora_on_cuda_holds_the_base_in_bf16_alone_and_trains(small_dataset, tmp_path):
    """LoRA under ZeRO-3 on one GPU: the frozen base is its bf16 copy alone (2 bytes per
    parameter), what the CUDA allocator holds at rest is the ledger, and the adapters train."""
    from tests.models import save_hf_model

    d = save_hf_model("llama", tmp_path / "llama")
    cfg = load_config(None, ["cluster.num_workers=1", "cluster.use_gpu=true", "model.kind=hf", f"model.path={d}",
                             "model.lora.r=8", "model.lora.target_modules=q_proj,v_proj,down_proj",
                             "sharding.strategy=optim_grads_params", "sharding.param_dtype=bf16", "train.seq_len=64",
                             "train.steps=20", "optim.warmup_steps=2", "optim.lr=1e-2"])
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    rank = Rank(cfg, 0, 1, small_dataset)
    info = rank.setup("127.0.0.1", free_port())
    held = torch.cuda.memory_allocated() - before
    mem, frozen = info["memory"], info["num_params"] - info["trainable_params"]
    assert mem["frozen_params"] == pytest.approx(2 * frozen, rel=0.02)
    assert mem["optimizer"] == pytest.approx(8 * info["trainable_params"], rel=0.05)
    assert mem["total"] <= held <= mem["total"] + 2**20
    losses = []
    for step in range(cfg.train.steps):
        out = rank.iteration({"step": step, "lr": lr_at(step, cfg.train.steps, cfg.optim)})
        losses.append(out["loss_sum"] / out["tokens"])
    rank.close()
    assert losses[-1] < losses[0]


def test_dropout_streams_on_the_gpu_replay_and_differ_by_tp_rank():
    """The streams swap the CUDA generator (where dropout on the GPU draws): the same
    micro-batch draws the same masks whatever came before, a restored state replays, and TP
    ranks share the replicated stream and own their split regions'."""
    from rayzero.sharding.rng import RandomStreams

    device = torch.device("cuda", torch.cuda.current_device())

    def masks(tp_rank: int):
        s = RandomStreams(seed=5, tp_rank=tp_rank, device=device)
        torch.rand(1000, device=device)  # whatever setup drew
        s.begin(step=3, micro=1)
        out = {"replicated": torch.rand(64, device=device)}
        before = s.state()
        s.enter("tp")
        out["tp"] = torch.rand(64, device=device)
        s.restore(before)
        s.enter("tp")
        out["tp again"] = torch.rand(64, device=device)
        return out

    a, b = masks(0), masks(1)
    assert torch.equal(a["replicated"], b["replicated"]) and not torch.equal(a["tp"], b["tp"])
    assert torch.equal(a["tp"], a["tp again"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vocabulary_parallel_loss_on_cuda_is_torchs(dtype):
    """The sharded cross-entropy on a group of one NCCL rank (its reductions run, over one rank):
    value and gradient as `F.cross_entropy` on the GPU, in fp32 and from bf16 logits."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from rayzero.sharding.comm import Axis
    from rayzero.sharding.vocab_parallel import VocabShard

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(2, 8, 11, device="cuda", generator=g).to(dtype).requires_grad_(True)
        targets = torch.randint(0, 11, (2, 8), device="cuda", generator=g)
        targets[0, 0] = -100
        shard = VocabShard(Axis(dist.group.WORLD, 1, 0), 11)
        loss, count = shard.token_loss(logits, targets)
        loss.backward()
        ref_logits = logits.detach().clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        ref.backward()
        assert int(count) == 15 and loss.item() == pytest.approx(ref.item(), rel=1e-5)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(logits.grad.float(), ref_logits.grad.float(), atol=tol)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_packed_examples_are_each_alone_on_cuda(kind, tmp_path):
    """On CUDA the GPT keeps packed examples apart with one masked SDPA call (its CPU path goes
    example by example) and an HF model through transformers' mask from the position ids: the
    loss of packed windows is their examples' one by one (tests/unit/test_packed.py on the CPU)."""
    from tests.models import save_hf_model
    from tests.unit.test_packed import instruction_data, model_of, one_by_one, records, windows

    data = instruction_data(tmp_path, "byte", records(40))
    keys = (["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.vocab_size=259"] if kind == "gpt" else
            ["model.kind=hf", f"model.path={save_hf_model('llama', tmp_path / 'llama')}"])
    spec, model = model_of(keys)
    model.cuda()
    batch = windows(data).to("cuda")
    packed, count, _ = spec.loss(model, batch)
    alone = [spec.loss(model, b) for b in one_by_one(batch)]
    assert int(count) == sum(int(n) for _, n, _ in alone)
    assert float(packed) == pytest.approx(float(sum(loss for loss, _, _ in alone)), rel=1e-5)


@pytest.mark.parametrize("slots", [0, 3])
def test_the_rollout_engine_samples_on_cuda_what_the_policy_gives(slots):
    """The transformers engine on CUDA, a group at a time and through a continuous batch: each
    sampled token's log-probability is the whole forward's on the same device, and a completion
    is a function of its seed (the same groups sampled again are the same); the draws stay on
    the CPU's generators (tests/unit/test_rollout_engines.py on the CPU)."""
    import transformers as tf

    from rayzero.rollout.engines import Sampling, TransformersEngine, draw_seed
    from tests.models import hf_config
    from tests.unit.test_rollout_engines import PROMPT, STOPS

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32).cuda().eval()
    engine, sampling = TransformersEngine(model, STOPS, "cuda"), Sampling(temperature=0.9, max_completion_length=24)
    groups = [(PROMPT[:k + 2], [draw_seed(0, 0, k, i) for i in range(4)]) for k in range(4)]
    got = engine.groups(groups, sampling, slots)
    assert engine.groups(groups, sampling, slots) == got
    for (prompt, _), done in zip(groups, got):
        for c in done:
            ids = torch.tensor([prompt + c.ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            want = torch.log_softmax(logits / 0.9, -1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu()
            assert torch.allclose(torch.tensor(c.logps), want, atol=1e-4)
