"""`train.compile` on real gloo groups, each run against the same configuration eager, on the
ranks as the actors run them (setup, then iterations):
- inductor, ZeRO-3 at world 2 (its unit gathers and releases outside the compiled blocks):
  every parameter within 1e-4 of eager after 10 steps, each step's loss within 1e-5; the first
  step reports its compile seconds, the steps after it none; inductor's caches in
  `train.compile_cache`;
- aot_eager (torch's own kernels behind the same tracing: the compiled graphs, the hooks and the
  streams, without generated code) bitwise equal to eager with dropout, which the generated
  configurations leave out (their oracle draws no masks): through tensor and sequence parallelism
  under ZeRO-3 with every block recomputed (the recompute calls the compiled block again, the
  dropout streams put back), through interleaved 1F1B (two model chunks a rank) under ZeRO-2, and
  through context parallelism's ring at cp 2 (the attention across the split left out of the
  compiled graphs) under ZeRO-3 with every block recomputed; each compiles at the first step
  only: hooks whose state changes from call to call (TP's regions, ZeRO-1/2's waits) run eagerly
  rather than being traced, which would recompile.
Every strategy, tp, pp schedule, cp mode, ep, recompute, LoRA, preference loss, precision and
model meets a compiled block in the generated configurations (`compile` in tests/combinations.py,
against their oracle, none compiling after its first step). `selective` recomputation with
compile is refused by the config (tests/unit/test_config.py)."""

import pytest
import torch
import torch.multiprocessing as mp

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist.pool import spawn
from tests.dist.reference import rel_error

pytestmark = pytest.mark.slow

STEPS = 3
INDUCTOR_STEPS = 10  # inductor's numerics: within 1e-4 of eager over 10 steps
GPT = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64"]


def config(model: list[str], world: int, extra=(), steps: int = STEPS):
    return load_config(None, [f"cluster.num_workers={world}", *model, "train.global_batch_size=8",
                              "train.micro_batch_size=2", f"train.steps={steps}", "optim.warmup_steps=1", *extra])


def _worker(rank, world, runs, ports, data_path, out):
    torch.set_num_threads(1)
    for (label, cfg), port in zip(runs, ports):
        r = Rank(cfg, rank, world, data_path)
        r.setup("127.0.0.1", port)
        steps = cfg.train.steps
        res = [r.iteration({"step": k, "lr": lr_at(k, steps, cfg.optim)}) for k in range(steps)]
        out[(label, rank)] = {"losses": [x["loss_sum"] for x in res], "state": r.full_state_dict(),
                              "compile_s": [x["phase_s"].get("torch_compile") for x in res]}
        r.close()


def run(runs: list, world: int, data_path: str) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_worker, args=(world, runs, [free_port() for _ in runs], data_path, out), nprocs=world)
        return dict(out)


def test_inductor_blocks_under_zero3_train_as_eager_does(small_dataset, tmp_path):
    zero3 = ["sharding.strategy=optim_grads_params"]
    cache = tmp_path / "compile_cache"
    runs = [("eager", config(GPT, 2, zero3, INDUCTOR_STEPS)),
            ("inductor", config(GPT, 2, [*zero3, "train.compile=true", f"train.compile_cache={cache}"], INDUCTOR_STEPS))]
    out = run(runs, 2, small_dataset)
    # inductor's caches went where train.compile_cache says: the compiled graphs, forward and backward
    assert [p.name for p in (cache / "fxgraph").glob("*/*")], sorted(p.name for p in cache.iterdir())
    assert [p.name for p in (cache / "aotautograd").glob("*")], sorted(p.name for p in cache.iterdir())
    for rank in range(2):
        eager, compiled = out[("eager", rank)], out[("inductor", rank)]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert eager["compile_s"] == [None] * INDUCTOR_STEPS, "an eager run reports no compilation"
        first, *after = compiled["compile_s"]
        assert first > 0 and after == [0.0] * (INDUCTOR_STEPS - 1), compiled["compile_s"]
    state, want = out[("inductor", 0)]["state"], out[("eager", 0)]["state"]
    assert state.keys() == want.keys()
    for k, v in want.items():
        assert rel_error(state[k], v) <= 1e-4, k


def test_aot_eager_blocks_with_dropout_are_bitwise_eager_through_tp_recompute_chunks_and_cp(small_dataset):
    aot = ["train.compile=true", "train.compile_backend=aot_eager"]
    tp = [*GPT, "model.dropout=0.1", "model.vocab_size=259", "parallel.tp=2", "parallel.sequence_parallel=true",
          "sharding.strategy=optim_grads_params", "model.activation_checkpointing=full"]
    chunks = [*GPT, "model.n_layer=4", "model.dropout=0.1", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
              "parallel.pp_virtual_stages=2", "sharding.strategy=optim_grads"]
    cp = [*GPT, "model.dropout=0.1", "parallel.cp=2", "sharding.strategy=optim_grads_params",
          "model.activation_checkpointing=full"]
    runs = [("tp", config(tp, 2)), ("tp-compiled", config(tp, 2, aot)),
            ("cp", config(cp, 2)), ("cp-compiled", config(cp, 2, aot)),
            ("chunks", config(chunks, 2)), ("chunks-compiled", config(chunks, 2, aot))]
    out = run(runs, 2, small_dataset)
    for name in ("tp", "chunks", "cp"):
        for rank in range(2):
            eager, compiled = out[(name, rank)], out[(f"{name}-compiled", rank)]
            assert compiled["losses"] == eager["losses"], (name, rank)
            first, *after = compiled["compile_s"]
            assert first > 0 and after == [0.0] * (STEPS - 1), (name, rank, compiled["compile_s"])
        state, want = out[(f"{name}-compiled", 0)]["state"], out[(name, 0)]["state"]
        assert state.keys() == want.keys()
        assert all(torch.equal(state[k], v) for k, v in want.items()), name
