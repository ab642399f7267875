"""Sharded training equals its oracle, for every configuration `tests/combinations.py` generates:
every pair of values of model x strategy x dp x tp x cp x ep x pp schedule x recompute x compile x
trainable x objective x precision x micro-batch x resume meets in at least one run, and the named triples
where an interaction is known run too. Each run trains 3 steps on real gloo groups (world 2 or 4),
as the actors run a rank: setup, then iterations, nothing reseeded in between.

The oracle: for the language-model loss, plain single-process torch on the same model, initial
weights and global batches (`torch.optim.AdamW`, weight decay on matrices, clipping engaged,
rayzero's schedule); LoRA against PEFT from the same initial adapters; frozen parameters frozen in
it; a mixture of experts with its router loss. For the preference losses, a user's own
objective (`own`: tests/own_objective.py, its metrics' sums and maxima too) and GRPO (recorded
completions replayed, each step's rollouts made by the driver's side as the plan carries them),
the same configuration at world 1 (which equals TRL's DPOTrainer and GRPOTrainer:
tests/e2e/test_dpo_trl.py, test_grpo_trl.py). Every parameter within
1e-5 relative (an attention key bias, whose gradient is zero up to rounding, only near its
start), every step's loss (and reward metric) within 1e-5. bf16 compute is held to the same run
in bf16 at world 1 (the curve within 2e-3, the update within 0.25) and, for the language-model
loss, to the fp32 oracle's curve within 1 %. Besides the oracle, each run shows what its axes promise:
- resume: saved after step 2 and resumed for step 3 in a new group, bitwise the straight run; the
  group is set up as one rebuilt after a commit is (its trainable weights left at zero for the load);
- compile (each block through dynamo, aot_eager): every rank compiles at the first step and at no
  later one, so nothing recompiles (an expert dispatch traced did, at every layer and step);
- pp: each rank's last step ran its schedule's compute in order and sent exactly the stage
  boundaries' bytes; the stages hold their blocks, a tied weight on both end stages;
- tp: a split weight is 1/tp a rank (the vocabulary padded to ceil(V/tp) rows), the rest whole;
- lora / frozen: the base (the frozen parameters) end bitwise where they began, the adapters
  start from what one process computes from the seed and their names, and only they get gradients;
- dpo: in fp32 the first step's loss is ln 2 and its rewards 0 (the policy is its reference);
- a mixture of experts reports its router loss; ZeRO-3 reads pretrained weights by range.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rayzero.cluster.checkpoints import Checkpoints
from rayzero.config import load_config
from rayzero.objectives.dpo import pair_metrics
from rayzero.step_report import merge
from tests import combinations as combos
from tests.conftest import free_port
from tests.dist.combination_ranks import _resume, _train
from tests.dist.pool import spawn
from tests.dist.reference import rel_error
from tests.dist.torch_oracle import initial_adapters, torch_oracle
from tests.dist.test_dpo import pairs
from tests.dist.test_models import key_bias
from tests.unit.test_packed import records
from tests.models import save_hf_model, save_tokenizer

pytestmark = pytest.mark.slow
STEPS, SAVE_AT = combos.STEPS, combos.SAVE_AT
BF16 = 0.01  # bf16 keeps 8 bits: each logit ~1.5 % of its spread; 3 steps' losses measured within 0.01 % of fp32's
# bf16 against itself at world 1: the losses measured within 2e-4 and the update within 0.11
# (tensor parallelism's partial sums); a missing write-back from the main weights leaves the
# update 1.0 away, a lost half of the gradients ~0.7
BF16_SAME, BF16_UPDATE = 2e-3, 0.25
# Gradients reduced in bf16 (`sharding.comm_dtype=bf16`) round each rank's sum to 8 bits, which
# world 1 never does: the curve is held to world 1's within what bf16 allows against fp32
BF16_COMM_SAME = BF16
# A pair loss's gradient is the difference of two sequences' (chosen minus rejected), small
# against the rounding of tensor parallelism's partial sums, which Adam's first steps turn into
# whole steps on a few elements: weights measured within 2e-5 of world 1. Its rewards are 0.1 x
# differences of sums of ~30 log-probabilities (~-150): their fp32 rounding is ~1e-6.
PAIR_TOL, REWARD_ABS = 5e-5, 1e-5
# Context parallelism's attention computes in fp32 where world 1's runs in bf16: another rounding,
# held within twice world 1's own distance from the fp32 curve (what bf16 allows: a pair loss of a
# model with large logits, the tests' module's, moves ~2 % at its second step)
BF16_CP = 2.0


# -- the models and data ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def combo_setup(tmp_path_factory, small_dataset) -> dict:
    """The models' directories (HF models saved by `save_pretrained`, 4 decoder layers) and the
    data: the stdlib's source as bytes, and preference pairs and instruction examples cut from it,
    tokenized by a BPE tokenizer of 250 tokens (within every model's vocabulary)."""
    root = tmp_path_factory.mktemp("combos")
    dirs = combos.save_models(root)
    tok = save_hf_model("llama", root / "tokenizer")
    save_tokenizer(tok, [Path(sys.modules["json"].__file__).read_text()], vocab=250)
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs(40)))
    from rayzero.data.tokens import prepare

    prepare(root / "pairs.jsonl", str(root / "pairs"), tokenizer=str(tok), preferences=True)
    (root / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(60)))
    prepare(root / "examples.jsonl", str(root / "examples"), tokenizer=str(tok), instructions=True)
    prompts, replay = combos.save_rollouts(root, tok)
    return {"dirs": dirs, "text": small_dataset, "pairs": str(root / "pairs"), "examples": str(root / "examples"),
            "prompts": prompts, "replay": replay, "root": root}


def model_keys(name: str, setup: dict) -> list[str]:
    return combos.model_keys(name, setup["dirs"])


def config_of(c: dict, setup: dict):
    """`c`'s config; one that resumes saves in a directory of its own."""
    where = setup["root"] / "ckpt" / combos.label(c)
    extra = [f"checkpoint.dir={where}", "checkpoint.every_steps=0"] if c["resume"] else []
    return load_config(None, [*combos.overrides(c, model_keys(c["model"], setup), replay=setup.get("replay")), *extra])


def data_of(c: dict, setup: dict) -> str:
    return {"lm": setup["text"], "sft": setup["examples"], "own": setup["examples"],
            "grpo": setup.get("prompts")}.get(c["objective"], setup["pairs"])


# -- the ranks: tests/dist/combination_ranks.py ------------------------------------------------------
def run_ranks(fn, world: int, *args, lane: str = "main") -> dict:
    out = manager().dict()
    spawn(fn, args=(world, *args, out), nprocs=world, lane=lane)
    return {r: out[r] for r in range(world)}


@functools.cache
def manager():
    """The ranks' results' way back: one server for the session, made before another lane's
    first job. A manager is a fork of this process; one made while another thread held a socket
    (`free_port`'s check of a port, bound for an instant) would keep that port bound, where no
    `ss` shows it, for the manager's life, and a rank 0 could not listen on it (EADDRINUSE: seen
    twice in three runs with a manager a job, never with one for the session)."""
    return mp.Manager()


# -- the next configurations' ranks, run while one is checked ------------------------------------------
# A configuration's ranks leave about 30 % of the 2 cores idle (waiting in collectives, one rank's
# imports or compile ahead of the other's), and its oracle and checks run in this process alone:
# the next AHEAD configurations' ranks (their 3 steps) run meanwhile, each in a lane of rank
# processes of its own. Each is the same job, on the same kind of process, as when run alone.
AHEAD = 2
_ahead: dict[str, Future] = {}  # label -> its ranks' results, on their way
_lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ahead{k}") for k in range(AHEAD)]


def train_ranks(c: dict, setup: dict, lane: str = "main") -> dict:
    """Configuration `c`'s 3 steps on its world's ranks (the step-2 checkpoint saved if it resumes)."""
    cfg, data = config_of(c, setup), data_of(c, setup)
    return run_ranks(_train, combos.world(c), cfg, data, free_port(), combos.rollout_plans(cfg, data), lane=lane)


def ranks_of(c: dict, setup: dict, request) -> dict:
    """`c`'s ranks' results: run ahead while an earlier configuration was checked, or now; the
    session's next configurations are started, each in its lane."""
    manager()  # before another lane's first job
    ahead = _ahead.pop(combos.label(c), None)
    for k, after in next_configurations(request):
        if combos.label(after) not in _ahead:
            _ahead[combos.label(after)] = _lanes[k % AHEAD].submit(train_ranks, after, setup, f"ahead{k % AHEAD}")
    return ahead.result() if ahead is not None else train_ranks(c, setup)


def next_configurations(request) -> list[tuple[int, dict]]:
    """(position, configuration) of the session's next AHEAD tests, up to one that is not this test's."""
    items = request.session.items
    i = items.index(request.node)
    out = []
    for k in range(i + 1, min(i + 1 + AHEAD, len(items))):
        if getattr(items[k], "originalname", None) != request.node.originalname:
            break
        out.append((k, items[k].callspec.params["c"]))
    return out


def commit(cfg, ranks: dict) -> str:
    """The step-2 checkpoint the ranks uploaded, committed as the controller commits it."""
    ckpt = Checkpoints(cfg)
    ckpt.configure([ranks[r]["info"] for r in sorted(ranks)], mlflow_run_id=None)
    ckpt.collect(SAVE_AT - 1, [{**ranks[r]["saved"], "uploads": []} for r in sorted(ranks)])
    ckpt.add_uploads([u for r in sorted(ranks) for u in ranks[r]["uploads"]])
    assert ckpt.last_committed, "the checkpoint must commit"
    return ckpt.last_committed


# -- the oracles -----------------------------------------------------------------------------------------
_oracles: dict = {}


def oracle(c: dict, setup: dict, precision: str = "fp32", fresh: bool = False) -> dict:
    """What configuration `c` must end on: {"state", "losses", "prefs" (per step, DPO only), "norms"
    (each step's gradient norm, before clipping)}.
    In fp32: plain torch (language modelling), or the configuration at world 1 (preference
    tuning). `precision="bf16"`: the configuration in bf16 at world 1 (data and pipeline
    parallelism give its weights bit for bit; tensor parallelism sums bf16 partial products in
    another order)."""
    moe = combos.MODELS[c["model"]].get("moe")
    key = (c["model"], c["trainable"], c["objective"], c["micro"] if moe or precision == "bf16" else None, precision)
    if key not in _oracles or fresh:  # fresh: computed again, not cached
        plain = {**c, "strategy": "no_shard", "dp": 1, "tp": "1", "pp": "1", "cp": "1", "ep": "1", "recompute": "none",
                 "precision": precision, "overlap": True, "resume": False}
        torch_plain = c["objective"] in ("lm", "sft") and precision == "fp32"
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as every rank computes: the oracle's rounding is not the machine's core count's
        try:
            made = torch_oracle(plain, config_of(plain, setup), setup) if torch_plain else world1_oracle(plain, setup)
        finally:
            torch.set_num_threads(threads)
        if fresh:
            return made
        _oracles[key] = made
    return _oracles[key]


def world1_oracle(c: dict, setup: dict) -> dict:
    cfg, data = config_of(c, setup), data_of(c, setup)
    ranks = run_ranks(_train, 1, cfg, data, free_port(), combos.rollout_plans(cfg, data))
    return {"state": ranks[0]["state"], "losses": step_losses(ranks), "prefs": step_prefs(ranks),
            "norms": [s["grad_norm"] for s in ranks[0]["steps"]]}


def step_losses(ranks: dict) -> list[float]:
    """Each step's global loss from the ranks' sums; the ranks agree on the gradient norm."""
    out = []
    for k in range(STEPS):
        parts = [ranks[r]["steps"][k] for r in sorted(ranks)]
        assert len({round(p["grad_norm"], 9) for p in parts}) == 1, f"step {k}: the ranks disagree on the grad norm"
        out.append(sum(p["loss_sum"] for p in parts) / sum(p["tokens"] for p in parts))
    return out


def step_prefs(ranks: dict) -> list[dict] | None:
    """Each step's reward metrics as the controller computes them from every rank's sums."""
    if not any(ranks[r]["steps"][0]["objective"]["sum"] for r in ranks):  # next-token: no metrics of its own
        return None
    out = []
    for k in range(STEPS):
        merged = merge([{"rank": r, "objective": ranks[r]["steps"][k]["objective"]} for r in sorted(ranks)])["objective"]
        out.append({**pair_metrics(merged["sum"]), **{f"max/{n}": v for n, v in merged["max"].items()}})
    return out


# -- the test -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("c", combos.CONFIGS, ids=[combos.label(c) for c in combos.CONFIGS])
def test_a_configuration_equals_its_oracle(c, combo_setup, request):
    from rayzero.jobs.train import check_model

    cfg = config_of(c, combo_setup)
    check_model(cfg)  # what the driver checks before a cluster starts accepts it
    world = combos.world(c)
    ranks = ranks_of(c, combo_setup, request)
    want = oracle(c, combo_setup)
    first = ranks[0]
    losses = step_losses(ranks)
    if c["precision"] == "fp32":
        try:
            assert_state(first["state"], want["state"], PAIR_TOL if combos.pairs(c["objective"]) else 1e-5)
        except AssertionError as e:  # which side moved: the oracle, computed again, against the one cached
            again = oracle(c, combo_setup, fresh=True)
            same = all(torch.equal(v, again["state"][k]) for k, v in want["state"].items())
            raise AssertionError(f"{e}; the oracle computed again {'equals' if same else 'differs from'} "
                                 f"the one cached") from e
        # GRPO's loss is a mean of advantages (~1), 0 at a round's first step: near 0, absolutely
        assert losses == pytest.approx(want["losses"], rel=1e-5, abs=1e-6 if c["objective"] == "grpo" else None)
        # the gradient's scale too (clipping and Adam would hide a uniform factor in the weights)
        assert [s["grad_norm"] for s in first["steps"]] == pytest.approx(want["norms"], rel=1e-4)
        if want["prefs"] is not None:
            for k, (got, exp) in enumerate(zip(step_prefs(ranks), want["prefs"])):
                assert got.keys() == exp.keys()
                for name in exp:
                    assert got[name] == pytest.approx(exp[name], rel=1e-5, abs=REWARD_ABS), (k, name)
    else:
        # bf16 compute (fp32 main weights and gradients): the curve of the same run at world 1 in
        # bf16, its update up to the order of bf16 partial sums; for language modelling also
        # fp32's curve (a pair loss at this scale is bf16 rounding: its rewards start near 0; GRPO's
        # loss is a mean of advantages, 0 at a round's first step)
        same = oracle(c, combo_setup, "bf16")
        tol = BF16_COMM_SAME if c["precision"] == "bf16-comm" else BF16_SAME
        if c["cp"] != "1":  # the attention across the split computes in fp32 where world 1's runs in bf16
            tol = max(tol, BF16_CP * max(abs(a - b) / abs(b) for a, b in zip(same["losses"], want["losses"])))
        assert losses == pytest.approx(same["losses"], rel=tol, abs=tol if c["objective"] == "grpo" else None), \
            "bf16 leaves its world-1 curve"
        assert_update(first["initial"], first["state"], same["state"], BF16_UPDATE)
        if not combos.pairs(c["objective"]) and c["objective"] != "grpo":  # GRPO's loss starts at 0 too
            assert losses == pytest.approx(want["losses"], rel=BF16), "bf16 leaves the fp32 curve"
            assert losses != pytest.approx(want["losses"], rel=1e-7), "not computing in bf16"

    for r in combos.stage_ranks(cfg):  # what the check of resumes builds on meta (tests/unit/test_resume_records.py)
        meta = combos.rank_identity(cfg, r)
        assert {k: ranks[r]["info"][k] for k in meta} == meta, f"rank {r} reports another model than its assembly's"
    if c["resume"]:  # saved after step 2, resumed in a new group: bitwise the straight run
        where = commit(cfg, ranks)
        from rayzero.jobs.preflight import resume_preview
        from rayzero.workers.assembly import make_spec

        found = resume_preview(Checkpoints(cfg), make_spec(cfg))  # the same command finds it its own
        assert found is not None and found.uri == where
        data = data_of(c, combo_setup)
        again = run_ranks(_resume, world, cfg, data, free_port(), where, combos.rollout_plans(cfg, data))
        assert all(again[r]["zero_before_load"] for r in again), "trainable weights given values the load overwrites"
        assert again[0]["state"].keys() == first["state"].keys()
        assert all(torch.equal(again[0]["state"][k], v) for k, v in first["state"].items())
        resumed = [sum(again[r]["losses"][0][0] for r in again) / sum(again[r]["losses"][0][1] for r in again)]
        assert resumed == losses[SAVE_AT:]
    if c["pp"] != "1":
        assert_pipeline(c, cfg, ranks)
    if c["compile"] != "off":  # every block compiled at the first step, and never again: nothing recompiles
        for r in ranks:
            first_s, *after = [s["compile_s"] for s in ranks[r]["steps"]]
            assert first_s > 0 and after == [0.0] * (STEPS - 1), (r, first_s, after)
    if c["tp"] != "1":
        assert_tensor_parallel(c, ranks)
    if c["trainable"] != "all":
        assert_trainable(c, combo_setup, ranks)
    if combos.pairs(c["objective"]) and c["precision"] == "fp32":  # the policy is its reference at the first step
        first_prefs = step_prefs(ranks)[0]
        # -log sigmoid(margin) = ln 2 - margin / 2 + ...: the margin's rounding (REWARD_ABS) bounds it
        assert step_losses(ranks)[0] == pytest.approx(math.log(2), abs=REWARD_ABS)
        assert first_prefs["rewards/margins"] == pytest.approx(0.0, abs=REWARD_ABS)
        assert first_prefs["rewards/chosen"] == pytest.approx(0.0, abs=REWARD_ABS)
    if combos.MODELS[c["model"]].get("moe"):
        assert sum(ranks[r]["steps"][0]["aux_loss_sum"] or 0.0 for r in ranks) > 0, "the router loss is reported"
        z = [sum(ranks[r]["steps"][k]["z_loss_sum"] or 0.0 for r in ranks) for k in range(len(ranks[0]["steps"]))]
        if "z_loss" in combos.MODELS[c["model"]]:  # and its z-loss, apart (`moe.router_z_loss`)
            assert all(v > 0 for v in z), z
        else:
            assert all(ranks[r]["steps"][0]["z_loss_sum"] is None for r in ranks)
        ep = 2 if c["ep"] != "1" else 1
        for r in ranks:  # the routed experts a bucket group of their own, over the ranks holding the same experts
            (dense, expert), experts = sorted(ranks[r]["info"]["bucket_groups"].items()), {
                n for n in ranks[r]["info"]["layout"]["param_order"] if ".experts." in n}
            assert dense[0].startswith("dense/") and expert[0].startswith("expert/"), r
            assert experts and set(expert[1]["params"]) == experts and not experts & set(dense[1]["params"]), r
            assert (expert[1]["shard"], expert[1]["reduce"]) == (dense[1]["shard"] // ep, dense[1]["reduce"] // ep), r
    if c["strategy"] == "optim_grads_params" and combos.MODELS[c["model"]]["kind"] == "hf" and c["pp"] == "1":
        full = sum(v.numel() for v in want["state"].values()) * 4  # each rank read about its shard of the weights
        # preference tuning and GRPO: the reference's shard too, read alike
        copies = 2 if combos.pairs(c["objective"]) or c["objective"] == "grpo" else 1
        assert all(ranks[r]["info"]["source_bytes_read"] < 1.6 * copies * full / c["dp"] for r in ranks)


def assert_state(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        (mine, my_key), (theirs, their_key) = key_bias(name, got[name]), key_bias(name, ref)
        if mine.numel() and not torch.equal(mine, theirs):  # (a zero tensor both sides: no relative error)
            err = rel_error(mine, theirs)
            assert err <= tol or cancelled_elements(mine, theirs, tol), f"{name}: {err:.2e}"
        if my_key is not None:  # at most lr (1e-3) per step from a start of +-0.02-size values
            assert (my_key - their_key).abs().max() <= 2 * STEPS * 1e-3, name


def cancelled_elements(mine: torch.Tensor, theirs: torch.Tensor, tol: float) -> bool:
    """Whether all but one element in a thousand (at least one) is within `tol` of the oracle,
    norm-wise, and those few within one learning rate (1e-3) a step. An element whose gradient is
    a sum that cancels to near zero is the key bias's case in one element: the summation order
    (a cp split's, a reduction's) sets its rounding, which Adam turns into a step of its own
    (measured: one element of 128 in a LoRA B at cp 2, 6.4e-7 off, the rest within 2e-10)."""
    d = (mine.double() - theirs.double()).abs().flatten()
    few = d.topk(max(1, d.numel() // 1000)).indices
    rest = torch.ones_like(d, dtype=torch.bool)
    rest[few] = False
    return bool(d[few].max() <= STEPS * 1e-3 and d[rest].norm() <= tol * theirs.double().norm())


def assert_update(initial: dict, got: dict, want: dict, tol: float) -> None:
    """The whole update (every parameter's, together) is `want`'s up to `tol`, relative."""
    names = [n for n in want if not torch.equal(want[n], initial[n])]
    mine = torch.cat([(got[n] - initial[n]).flatten() for n in names])
    theirs = torch.cat([(want[n] - initial[n]).flatten() for n in names])
    assert names and rel_error(mine, theirs) <= tol, f"the update is {rel_error(mine, theirs):.3f} from its oracle's"


def assert_pipeline(c: dict, cfg, ranks: dict) -> None:
    from rayzero.pipeline.schedules import schedule

    v = 2 if c["pp"] == "interleaved" else 1
    m = combos.micro_batches(c)
    actions = schedule(combos.SCHEDULE[c["pp"]], 2, m, v)
    for r, got in ranks.items():  # each rank ran its schedule's compute in its order
        assert got["trace"] == [str(a) for a in actions[got["info"]["pp_rank"]] if a.op in ("F", "B", "I", "W")], r
    if not combos.pairs(c["objective"]) and not combos.MODELS[c["model"]].get("moe"):
        # one activation forward and one gradient back per micro-batch at each of the 2v - 1 boundaries,
        # by every rank of a stage (its sequence shard with sequence parallelism); GRPO's reference
        # (beta > 0) sends its forward's activations through the stages too
        tp = combos.tp_size(c["tp"])
        seq = cfg.train.seq_len // (tp if c["tp"].endswith("sp") else 1)
        hidden = 32
        activation = c["micro"] * seq * hidden * (2 if c["precision"] != "fp32" else 4)
        crossings = 3 if c["objective"] == "grpo" else 2
        assert sum(got["sent"] for got in ranks.values()) == c["dp"] * tp * crossings * (2 * v - 1) * m * activation
    stages = [set().union(*(set(ranks[r]["info"]["params"]) for r in ranks if ranks[r]["info"]["pp_rank"] == s))
              for s in (0, 1)]
    assert stages[0] | stages[1] == set(ranks[0]["info"]["params"]) | stages[1]
    shared = stages[0] & stages[1]
    assert len(shared) == (1 if combos.MODELS[c["model"]].get("tied") else 0), shared  # the tied weight: both ends


def assert_tensor_parallel(c: dict, ranks: dict) -> None:
    """A split weight is 1/tp a rank (the vocabulary padded to whole rows), the rest whole."""
    tp = combos.tp_size(c["tp"])
    for r, got in ranks.items():
        info = got["info"]
        split = info["tp"]["split"]
        held = {n: end - start for n, (start, end) in zip(info["layout"]["param_order"], info["layout"]["param_world"])}
        assert split, "the plan splits something"
        for name, n in held.items():
            shape = info["params"][name]
            whole = math.prod(shape)
            if name not in split:
                assert n == whole, (r, name)
            elif split[name].get("padded"):
                rows = shape[split[name]["dim"]]
                assert n == -(-rows // tp) * (whole // rows), (r, name)
            else:
                assert n == whole // tp, (r, name)


def assert_trainable(c: dict, setup: dict, ranks: dict) -> None:
    """LoRA's base, or the frozen parameters, end bitwise where they began and get no gradient;
    LoRA's adapters start from what one process computes from the seed and their names alone
    (at any world size, TP or PP), and train."""
    first = ranks[0]
    frozen = set().union(*(ranks[r]["info"]["frozen"] for r in ranks))  # each stage's
    assert frozen and frozen <= set(first["state"])
    for r in ranks:
        assert not ranks[r]["grads"] & frozen, r
    adapters = {n for n in first["state"] if ".lora_" in n}
    assert (c["trainable"] == "lora") == bool(adapters) and not adapters & frozen
    base = [n for n in first["state"] if n not in adapters and (c["trainable"] == "lora" or n in frozen)]
    assert all(torch.equal(first["state"][n], first["initial"][n]) for n in base), "the base moved"
    if c["trainable"] == "lora":
        plain = {**c, "dp": 1, "tp": "1", "pp": "1", "ep": "1", "strategy": "no_shard"}
        expected = initial_adapters(config_of(plain, setup))
        assert all(torch.equal(first["initial"][n], expected[n]) for n in adapters)
        assert all(torch.count_nonzero(first["state"][n]) for n in adapters if ".lora_B." in n), "B trains"

