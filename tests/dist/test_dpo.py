"""Preference tuning sharded equals its single-process run: an HF Llama, a BPE tokenizer trained
here and preference pairs cut from the stdlib's source, `train.objective=dpo` for a few steps at
world 2 and 4 under every strategy, with activation checkpointing, at tp 2, at pp 2, with LoRA
and with the reference's log-probabilities precomputed: the weights within 1e-5 of world 1,
the loss and every reward metric equal. (World 1 equals TRL's DPOTrainer: `tests/e2e/test_dpo.py`.)"""

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.data.tokens import prepare
from rayzero.objectives.dpo import pair_metrics
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist.pool import spawn
from tests.dist.reference import rel_error
from tests.models import save_hf_model, save_tokenizer

pytestmark = pytest.mark.slow

STEPS = 3
SEQ = 40
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def pairs(n: int, seed: int = 0) -> list[dict]:
    """Prompts and two completions of different lengths, cut from the stdlib's source."""
    words = Path(sys.modules["json"].__file__).read_text().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randrange(len(words) - 60)
        out.append({"prompt": "Q: " + " ".join(words[a: a + rng.choice([2, 5, 9])]) + "\nA:",
                    "chosen": " " + " ".join(words[a + 10: a + 10 + rng.choice([3, 8, 30])]),
                    "rejected": " " + " ".join(words[a + 40: a + 40 + rng.choice([1, 6, 25])])})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    model = save_hf_model("llama", root / "llama", seed=5)
    save_tokenizer(model, [Path(sys.modules["json"].__file__).read_text()], vocab=300)
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs(40)))
    prepare(root / "pairs.jsonl", str(root / "data"), tokenizer=str(model), preferences=True)
    return str(model), str(root / "data")


def config(world: int, model: str, extra=()):
    return load_config(None, [
        f"cluster.num_workers={world}", "model.kind=hf", f"model.path={model}", "train.objective=dpo",
        f"train.seq_len={SEQ}", "train.global_batch_size=8", f"train.micro_batch_size={2 if world > 1 else 4}",
        f"train.steps={STEPS}", "train.seed=3", "sharding.bucket_numel=3000", "sharding.shard_align=1",
        "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=1", "optim.weight_decay=0.1",
        "optim.grad_clip=0.5", *extra])


def _worker(rank: int, world: int, runs, ports, data: str, out: dict):
    torch.set_num_threads(1)
    for (label, cfg), port in zip(runs, ports):
        r = Rank(cfg, rank, world, data)
        info = r.setup("127.0.0.1", port)
        steps = []
        for step in range(STEPS):
            res = r.iteration({"step": step, "lr": lr_at(step, STEPS, cfg.optim)})
            steps.append({"loss_sum": res["loss_sum"], "tokens": res["tokens"], "prefs": res["objective"]["sum"],
                          "memory": res["memory"]})
        state = r.full_state_dict()
        out[(label, rank)] = {"steps": steps, "info": info, **({"state": state} if rank == 0 else {})}
        r.close()


def run_ranks(world: int, runs, data: str) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_worker, args=(world, runs, [free_port() for _ in runs], data, out), nprocs=world)
        return dict(out)


def step_metrics(results, label, world) -> list[dict]:
    """Each step's loss and pair metrics as the controller computes them from every rank's."""
    out = []
    for k in range(STEPS):
        parts = [results[(label, r)]["steps"][k] for r in range(world)]
        sums: dict = {}
        for p in parts:
            for name, v in p["prefs"].items():
                sums[name] = sums.get(name, 0.0) + v
        out.append({"loss": sum(p["loss_sum"] for p in parts) / sum(p["tokens"] for p in parts),
                    **pair_metrics(sums)})
    return out


@pytest.fixture(scope="module")
def single(setup):
    model, data = setup
    runs = [("full", config(1, model)), ("lora", config(1, model, ["model.lora.r=4"]))]
    return run_ranks(1, runs, data)


def assert_equal(results, label, world, ref, ref_label):
    state, want = results[(label, 0)]["state"], ref[(ref_label, 0)]["state"]
    assert state.keys() == want.keys()
    for name, w in want.items():
        assert rel_error(state[name], w) <= 1e-5, f"{label} world {world}, {name}"
    got, expected = step_metrics(results, label, world), step_metrics(ref, ref_label, 1)
    for k, (g, e) in enumerate(zip(got, expected)):
        assert g.keys() == e.keys()
        for name in e:
            assert g[name] == pytest.approx(e[name], rel=1e-5, abs=1e-6), (label, world, k, name)


def test_the_first_step_is_ln2_and_the_margin_moves(single):
    """Policy = reference at the first step: every pair's loss is ln 2, its rewards 0."""
    m = step_metrics(single, "full", 1)
    assert m[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert m[0]["rewards/margins"] == 0.0 and m[0]["rewards/chosen"] == 0.0
    assert m[-1]["rewards/margins"] > 0  # the updates favour the chosen completions
    full = single[("full", 0)]
    # the reference: a frozen copy in the compute dtype, beside the model state; LoRA has none
    assert full["steps"][0]["memory"]["reference_params"] == pytest.approx(4 * full["info"]["num_params"], rel=0.01)
    assert single[("lora", 0)]["steps"][0]["memory"]["reference_params"] == 0
    assert step_metrics(single, "lora", 1)[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)


