"""ZeRO-3's schedule on real gloo groups (world 2), and fp16 loss scaling.

- materialized from the meta device shard by shard, the model starts from exactly the
  unsharded model's weights;
- at rest every unit is released: a rank holds only its shards;
- never more than two units are whole at once, in forward or backward;
- the next unit's all-gather starts before the current unit computes (prefetch), and backward
  gathers each unit again, last first, but the last of the forward, whole until its backward;
- `close()` releases the shards and main parameters while the `Rank` is still referenced;
- fp16 with a loss scale that overflows: those steps are skipped (parameters untouched, the
  scale halves, the step says so), then training proceeds and the loss falls.
"""

import weakref

import pytest
import torch
import torch.multiprocessing as mp

from rayzero.config import load_config
from rayzero.models.gpt import build_model
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist.pool import spawn

pytestmark = pytest.mark.slow

WORLD = 2
BASE = [f"cluster.num_workers={WORLD}", "model.n_layer=3", "model.n_embd=64", "model.n_head=4",
        "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=0"]


def _zero3(rank: int, port: int, data_path: str, out: dict):
    torch.set_num_threads(1)
    r = Rank(load_config(None, BASE + ["sharding.strategy=optim_grads_params"]), rank, WORLD, data_path)
    r.setup("127.0.0.1", port)
    initial = r.full_state_dict()  # materialized shard by shard from the meta device
    s, buf = r.strategy.groups[0].placement, r.strategy.buffer  # ZeRO-3's ShardedUnits (the one group)
    events, resident_counts = [], []
    unit_of_bucket = dict(s._bucket_unit)
    start, restore = s._start_gather, buf.restore

    def start_gather(units):
        for u in units:
            if not set(s._unit_buckets[u]) <= s._resident:
                events.append(("gather", s.units.modules[u]))
        start(units)

    def counting_restore(b):
        restore(b)
        resident_counts.append(sum(buf.is_resident(x) for x in buf.buckets))

    s._start_gather, buf.restore = start_gather, counting_restore
    modules = dict(r.model.named_modules())
    for name in s.units.modules:  # registered after the strategy's hooks: runs once gathered
        modules[name].register_forward_pre_hook(lambda _m, _a, name=name: events.append(("compute", name)))
    r.model.register_forward_pre_hook(lambda *_: events.append(("forward", None)))  # each micro-batch's
    losses = []
    for k in range(3):
        losses.append(r.iteration({"step": k, "lr": 3e-3})["loss_sum"])
    got = {
        "events": events, "max_resident": max(resident_counts),
        "resident_at_rest": [buf.is_resident(b) for b in buf.buckets],
        "param_storage_at_rest": [p.untyped_storage().nbytes() for p in buf.params],
        "units": list(s.units.modules), "losses": losses, "unit_of_bucket": unit_of_bucket,
        "initial": initial,
    }
    # close() releases the model's state while the Rank itself is still referenced (a kept
    # process's next run, a GPU's allocator): the shards and the main parameters are gone.
    held = [weakref.ref(t) for t in (*buf.data, *r.strategy.main_params) if t is not None]
    s = buf = modules = start = restore = None  # the Rank alone holds its state now
    r.close()
    got["alive_after_close"] = sum(ref() is not None for ref in held)
    out[rank] = got


def test_zero3_gathers_ahead_releases_after_and_keeps_at_most_two_units(small_dataset):
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_zero3, args=(free_port(), small_dataset, out), nprocs=WORLD)
        results = dict(out)
    cfg = load_config(None, BASE)
    plain = build_model(cfg.model, cfg.block_size, cfg.train.seed).state_dict()
    initial = results[0]["initial"]
    assert initial.keys() == plain.keys()
    assert all(torch.equal(initial[k], v) for k, v in plain.items()), "same init as the unsharded model"
    for rank, got in results.items():
        assert not any(got["resident_at_rest"]) and not any(got["param_storage_at_rest"])
        assert got["alive_after_close"] == 0, "close() releases the shards and main parameters"
        assert got["max_resident"] == 2, "prefetch keeps two units whole, never more"
        ev = got["events"]
        blocks = [u for u in got["units"] if u.startswith("blocks.")]
        starts = [i for i, e in enumerate(ev) if e == ("forward", None)]
        ends = [ev.index(("compute", "lm_head"), i) for i in starts]
        assert len(starts) == 3 * 2, "3 iterations of 2 micro-batches"
        for m, (start, end) in enumerate(zip(starts, ends)):
            forward = ev[start:end + 1]
            for this, nxt in zip(blocks, blocks[1:]):
                assert forward.index(("gather", nxt)) < forward.index(("compute", this)), \
                    f"{nxt} must be gathered while {this} computes"
            # Backward gathers each unit again, last first (the tied head's first: the embedding).
            # Once a forward's order is known (after the first), the units of its last two modules
            # (the head's and the final norm's: as many as prefetch holds whole) stay whole from
            # their forward to their backward. The embeddings' backward reads no weights: their
            # units are not gathered for it (the gradients are checked against the reference in
            # test_matches_reference.py and every generated configuration).
            backward = ev[end + 1: starts[m + 1] if m + 1 < len(starts) else None]
            regathered = [u for kind, u in backward if kind == "gather"]
            kept = 0 if m == 0 else 2
            assert regathered == ["wte", "ln_f", *blocks[::-1]][kept:], (m, regathered)


def _fp16(rank: int, port: int, data_path: str, out: dict):
    torch.set_num_threads(1)
    cfg = load_config(None, BASE + ["sharding.strategy=optim", "sharding.param_dtype=fp16",
                                    "sharding.initial_loss_scale=1e9", "sharding.bucket_numel=20000"])
    r = Rank(cfg, rank, WORLD, data_path)
    r.setup("127.0.0.1", port)
    steps = []
    for k in range(16):
        before = [m.clone() for m in r.strategy.main_params]
        res = r.iteration({"step": k, "lr": 3e-3})
        changed = any(not torch.equal(a, b) for a, b in zip(before, r.strategy.main_params))
        steps.append({"skipped": res["skipped"], "scale": res["loss_scale"], "changed": changed,
                      "loss": res["loss_sum"] / res["tokens"]})
    out[rank] = steps
    r.close()


def test_fp16_skips_overflowing_steps_and_then_trains(small_dataset):
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_fp16, args=(free_port(), small_dataset, out), nprocs=WORLD)
        results = dict(out)
    steps = results[0]
    assert [s["skipped"] for s in steps] == [s["skipped"] for s in results[1]], "ranks agree on skipping"
    skipped = [s for s in steps if s["skipped"]]
    assert steps[0]["skipped"] and 0 < len(skipped) < len(steps)
    assert all(not s["changed"] for s in skipped), "a skipped step leaves the parameters alone"
    assert all(s["changed"] for s in steps if not s["skipped"])
    scales = [s["scale"] for s in steps]
    assert scales[1] == scales[0] / 2 and scales[-1] < 1e9 / 2
    trained = [s["loss"] for s in steps if not s["skipped"]]
    assert trained[-1] < steps[0]["loss"] - 0.2
