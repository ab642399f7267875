"""Users' models against a plain single-process torch run, and what the other equality tests
share: the models' saved directories, their plain torch builds, the ranks' loop and the
comparison (the key bias held apart).

Every model family under every strategy is in tests/dist/test_combinations.py (pairwise with
the other axes); here: with masked targets (labels -100) the loss is normalized by the step's
global count of valid targets, so world 2 (whose ranks count differently) equals the reference.
"""

import pytest
import torch
import torch.multiprocessing as mp

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.workers.assembly import make_spec
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist.pool import spawn
from tests.dist.reference import MaskedBatches, rel_error, train_reference
from tests.models import TinyLM, save_hf_model

pytestmark = pytest.mark.slow

STEPS = 3  # what 10 steps show of an optimizer and a reduction, 3 show
MICRO = 2
ARCHS = ["llama", "llama-untied", "gpt2", "qwen2"]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
HYBRID = [("hsdp", ["sharding.strategy=optim_grads_params", "sharding.dp_outer=2"]),
          ("hfsdp", ["sharding.strategy=optim_grads_params", "sharding.dp_outer=2", "sharding.outer_strategy=optim"])]


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: str(save_hf_model(arch, root / arch, seed=i)) for i, arch in enumerate(ARCHS)}


def model_keys(name: str, hf_dirs: dict) -> list[str]:
    if name == "module":
        return ["model.kind=module", "model.factory=tests.models:TinyLM"]
    return ["model.kind=hf", f"model.path={hf_dirs[name]}"]


def config(world: int, accum: int, model: list[str], extra=()):
    return load_config(None, [
        f"cluster.num_workers={world}", *model,
        "train.seq_len=32", f"train.global_batch_size={world * MICRO * accum}",
        f"train.micro_batch_size={MICRO}", f"train.steps={STEPS}", "train.seed=7",
        "sharding.bucket_numel=3000", "sharding.shard_align=1",  # several buckets, odd cuts
        "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=1",
        "optim.weight_decay=0.1", "optim.grad_clip=0.5", *extra,
    ])


def reference_model(name: str, cfg, hf_dirs: dict):
    """The same model with the same initial weights, built the plain way."""
    if name == "module":
        model = TinyLM()
        spec = make_spec(cfg)
        source = spec.source(spec.build())
        with torch.no_grad():
            for n, p in model.named_parameters():
                source.fill(n, p)
        return model
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(hf_dirs[name], dtype=torch.float32)


def _worker(rank: int, world: int, runs, ports, data_path: str, masked: bool, out: dict):
    torch.set_num_threads(1)
    for (label, cfg), port in zip(runs, ports):
        r = Rank(cfg, rank, world, data_path)
        info = r.setup("127.0.0.1", port)
        if masked:
            r.data = MaskedBatches(r.data)
        losses = []
        for step in range(STEPS):
            res = r.iteration({"step": step, "lr": lr_at(step, STEPS, cfg.optim)})
            losses.append((res["loss_sum"], res["tokens"]))
        state = r.full_state_dict()
        out[(label, rank)] = {"losses": losses, "info": info, **({"state": state} if rank == 0 else {})}
        r.close()


def run_ranks(world: int, runs, data_path: str, masked: bool = False) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        ports = [free_port() for _ in runs]
        spawn(_worker, args=(world, runs, ports, data_path, masked, out), nprocs=world)
        return dict(out)


def key_bias(name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the part held to 1e-5, the attention key bias in it or None).

    A bias added to every key shifts all of a query's scores alike, so softmax cancels it: its
    gradient is zero up to rounding, and Adam turns that rounding noise (which depends on the
    summation order) into full +-lr steps either way. So the key bias is held only to staying
    near its start; everything else to 1e-5."""
    if name.endswith("k_proj.bias"):
        return t[:0], t
    if name.endswith(("attn.c_attn.bias", "in_proj_bias", "attn.qkv.bias")):  # GPT-2, torch, rayzero GPT: q|k|v
        q, k, v = t.chunk(3)
        return torch.cat([q, v]), k
    return t, None


def assert_matches(results, label, world, ref_state, ref_losses):
    got = results[(label, 0)]
    assert got["state"].keys() == ref_state.keys(), label
    for name, ref in ref_state.items():
        (mine, my_key), (theirs, their_key) = key_bias(name, got["state"][name]), key_bias(name, ref)
        if mine.numel():
            err = rel_error(mine, theirs)
            assert err <= 1e-5, f"{label} world {world}, {name}: {err:.2e}"
        if my_key is not None:  # at most lr (1e-3) per step from a start of +-0.02-size values
            assert (my_key - their_key).abs().max() <= 2 * STEPS * 1e-3, f"{label} world {world}, {name}"
    losses = [sum(results[(label, r)]["losses"][k][0] for r in range(world))
              / sum(results[(label, r)]["losses"][k][1] for r in range(world)) for k in range(STEPS)]
    assert losses == pytest.approx(ref_losses, rel=1e-5), label


@pytest.mark.parametrize("world", [2])
def test_masked_targets_normalize_by_the_global_valid_count(world, hf_dirs, small_dataset):
    """Labels of -100 take no part, and every world size gives the reference's result: each
    rank divides by the valid targets of the whole step, not of its own rows."""
    keys = model_keys("llama", hf_dirs)
    base = config(world, 2 if world < 4 else 1, keys)
    ref_state, ref_losses = train_reference(reference_model("llama", base, hf_dirs), base, small_dataset, STEPS,
                                            masked=True)
    _, unmasked = train_reference(reference_model("llama", base, hf_dirs), base, small_dataset, 1)
    assert abs(ref_losses[0] - unmasked[0]) > 1e-3, "the mask must change the loss for the test to mean anything"
    strategies = ["no_shard", "optim_grads_params"] if world > 1 else ["no_shard"]
    runs = [(s, base.override(f"sharding.strategy={s}")) for s in strategies]
    results = run_ranks(world, runs, small_dataset, masked=True)
    for label, _ in runs:
        assert_matches(results, label, world, ref_state, ref_losses)
    if world > 1:  # the ranks' own counts differ: a per-rank mean would not match
        counts = {results[("no_shard", r)]["losses"][0][1] for r in range(world)}
        assert len(counts) > 1


def _reads(rank: int, world: int, cfg, data_path: str, port: int, out: dict):
    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data_path)
    r.setup("127.0.0.1", port)
    for step in range(2):
        r.iteration({"step": step, "lr": lr_at(step, STEPS, cfg.optim)})
    buffer = r.strategy.buffer
    in_proj = {buffer.bucket_of(i) for i, n in enumerate(buffer.names) if n.endswith("attn.in_proj_weight")}
    reads = [part.owner.reads for part in r.strategy.groups]
    out[rank] = {"found": [f for w in reads for f in w.found], "in_proj": in_proj,
                 "done": [w.done for w in reads]}
    r.close()


def test_a_parameter_read_without_its_module_waits_for_the_overlapped_gather(small_dataset):
    """The tests' module reads its attention's weights (`nn.MultiheadAttention`'s) without
    calling the attention. Under ZeRO-1 with the all-gather overlapped with forward, the first
    forward after a step finds those reads, and each block waits for those buckets at its start
    from then on (without that, the block read what the gather had not written yet: values of
    the step before, on the ranks the timing chose). Equality with torch is held under every
    strategy in tests/dist/test_combinations.py."""
    cfg = config(2, 1, model_keys("module", {}), ["sharding.strategy=optim"])
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_reads, args=(2, cfg, small_dataset, free_port(), out), nprocs=2)
        got = dict(out)
    for rank in range(2):
        found, in_proj = got[rank]["found"], got[rank]["in_proj"]
        assert got[rank]["done"] == [True]
        assert {b for _, b in found} == in_proj, found  # the attention weights' buckets, and no other
        assert {n for n, _ in found} == {"layers.0", "layers.1"}, found  # each waited for by the block reading it
