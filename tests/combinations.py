"""The configurations the sharded-training equality tests run, generated so that every pair of
values of any two axes meets in at least one of them (`tests/allpairs.py`), plus the named
triples where an interaction is known. A new option or axis joins `AXES` (and `RULES`, where
the product refuses some of its pairs): the generator finds the configurations that cover its
pairs, instead of a new product of tests.

Each configuration trains `STEPS` steps of a global batch of `GLOBAL_BATCH` rows on
`world = dp x cp x tp x pp` ranks (at most 4) and is held to its oracle (tests/dist/test_combinations.py):
plain single-process torch for the language-model loss (PEFT for LoRA) on text or on packed
instruction examples (`sft`: each example attending to itself alone, as the model seam's unit
test shows a packed window's loss to be its examples' one by one), the same run at world 1 for
the preference losses; bf16 follows the fp32 oracle's curve.
"""

from __future__ import annotations

import functools

from tests.allpairs import Rules, all_pairs, infeasible_pairs

STEPS = 3  # 3 steps show what 10 do for an optimizer, a reduction or a resume
GLOBAL_BATCH = 8  # rows per step, at every world size: micro-batches per rank = 8 / (dp x micro)
SAVE_AT = 2  # a resumed configuration is saved after step 2 and resumed for its last step

# The models, 4 blocks each (interleaved at pp 2 x 2 chunks: one per stage), vocabularies of 259
# tokens where tensor parallelism pads them (neither 2 nor 4 divides 259) and 320 elsewhere.
# `lora`: target modules where PEFT has no default for the model; `freeze`: what `trainable=frozen`
# freezes (the first block, and the embedding the head is tied to where there is one).
MODELS = {
    "gpt": dict(kind="gpt", tied=True, tp=True, lora="qkv,fc", freeze="wte.*,blocks.0.*"),
    "llama": dict(kind="hf", arch="llama", tied=True, tp=True, vocab=259, num_key_value_heads=1,  # kv replicated at tp 2
                  freeze="model.embed_tokens.*,model.layers.0.self_attn.*"),
    "llama-untied": dict(kind="hf", arch="llama-untied", tp=True, vocab=259, freeze="model.layers.0.*"),
    "qwen2": dict(kind="hf", arch="qwen2", tp=True, freeze="model.layers.0.mlp.*"),  # biases on q/k/v
    "gpt2": dict(kind="hf", arch="gpt2", tied=True, freeze="transformer.h.0.*"),  # Conv1D, learned positions
    "module": dict(kind="module", tied=True, lora="fc,proj", freeze="layers.0.*"),  # a user's nn.Module
    "mixtral": dict(kind="hf", arch="mixtral", moe=True, tp=True, lora="q_proj,v_proj", freeze="model.layers.0.*"),
    "qwen2_moe": dict(kind="hf", arch="qwen2_moe", moe=True, tp=True, lora="q_proj,v_proj",  # a shared expert
                      freeze="model.layers.0.*", z_loss=0.01),  # and a router z-loss
}
HYBRID = {"hsdp": "no_shard", "hfsdp": "optim"}  # ZeRO-3 in each replica; the optimizer state across replicas too
SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved_1f1b", "zb": "zero_bubble"}

AXES = {
    "model": list(MODELS),
    "strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params", "hsdp", "hfsdp"],
    "dp": [2, 1],
    "tp": ["1", "2", "2sp", "4"],
    "cp": ["1", "ring", "ulysses"],  # context parallelism at 2, attention across the split each way
    "ep": ["1", "2"],  # a mixture of experts' experts split over 2 data-parallel ranks
    "pp": ["1", "gpipe", "1f1b", "interleaved", "zb"],
    "recompute": ["none", "full", "selective", "every:2"],
    "compile": ["off", "aot_eager"],  # each block compiled (train.compile), torch's own kernels behind dynamo's trace
    "trainable": ["all", "lora", "frozen"],
    # lm: text windows; sft: instruction examples packed into windows, each attending to itself alone;
    # own: a user's objective from a module (tests/own_objective.py) on those examples;
    # grpo: online RL on recorded completions (GRPO_KEYS), against a reference, two steps a round
    "objective": ["lm", "sft", "dpo", "dpo-precomputed", "own", "grpo"],
    "precision": ["fp32", "bf16", "bf16-comm"],  # bf16 compute; also bf16 gradients on the wire
    "overlap": [True, False],  # gradient reduction and parameter gathering overlapped with compute
    "micro": [2, 4],  # rows per micro-batch
    "resume": [False, True],  # saved after step SAVE_AT and resumed: bitwise the straight run
}


# GRPO's configurations: recorded completions (`save_rollouts`) replayed, 2 prompts x 4 a step,
# the per-sequence loss (whole rows' lengths under cp), a KL penalty to a reference (a frozen
# copy, or the base with LoRA's adapters off), clip-higher at a sampling temperature, and two
# optimizer steps a round (the second's ratio against the first's log-probabilities)
GRPO_G, GRPO_COMPLETION = 4, 8
GRPO_KEYS = ["train.objective=grpo", f"grpo.num_generations={GRPO_G}", f"grpo.max_completion_length={GRPO_COMPLETION}",
             "grpo.loss_type=grpo", "grpo.beta=0.1", "grpo.num_iterations=2", "grpo.epsilon_high=0.28",
             "grpo.temperature=0.8", "rollout.engine=replay"]


def pairs(objective: str) -> bool:
    """Whether the objective is a preference loss over pairs."""
    return objective.startswith("dpo")


def tp_size(tp: str) -> int:
    return int(tp.rstrip("sp"))


def pp_size(pp: str) -> int:
    return 1 if pp == "1" else 2


def cp_size(cp: str) -> int:
    return 1 if cp == "1" else 2


def kv_heads(model: str) -> int:
    """Key/value heads of the tests' models: the GPT's, GPT-2's and the module's 4 (one per head),
    the HF decoders' 2 (tests/models.py) unless set."""
    m = MODELS[model]
    return m.get("num_key_value_heads", 4 if m["kind"] in ("gpt", "module") or m.get("arch") == "gpt2" else 2)


def micro_batches(c: dict) -> int:
    """Micro-batches per data-parallel rank per step."""
    return GLOBAL_BATCH // (c["dp"] * c["micro"])


def _schedule_ok(pp: str, dp: int, micro: int) -> bool:
    from rayzero.pipeline.schedules import check

    if pp == "1":
        return True
    m = GLOBAL_BATCH // (dp * micro)
    return check(SCHEDULE[pp], 2, m, 2 if pp == "interleaved" else 1) is None


RULES = Rules()
RULES.rule("at most 4 ranks, at least 2", ["dp", "tp", "pp", "cp"],
           lambda dp, tp, pp, cp: 2 <= dp * tp_size(tp) * pp_size(pp) * cp_size(cp) <= 4)
RULES.rule("a strategy shards over data-parallel x cp ranks", ["strategy", "dp", "cp"],
           lambda strategy, dp, cp: dp * cp_size(cp) > 1 or strategy == "no_shard")
RULES.rule("hybrid sharding's replicas are data-parallel ranks", ["strategy", "dp"],
           lambda strategy, dp: strategy not in HYBRID or dp > 1)
RULES.rule("expert parallelism splits a mixture of experts' experts", ["model", "ep"],
           lambda model, ep: ep == "1" or bool(MODELS[model].get("moe")))
RULES.rule("expert parallelism folds into the data-parallel ranks", ["dp", "ep"],
           lambda dp, ep: ep == "1" or dp % 2 == 0)
RULES.rule("hybrid sharding's replicas and expert parallelism share the data-parallel ranks", ["strategy", "ep"],
           lambda strategy, ep: ep == "1" or strategy not in HYBRID)
RULES.rule("ulysses splits a tensor-parallel rank's key/value heads", ["model", "cp", "tp"],
           lambda model, cp, tp: cp != "ulysses" or max(kv_heads(model) // tp_size(tp), 1) % 2 == 0)
RULES.rule("whole micro-batches", ["dp", "micro"], lambda dp, micro: GLOBAL_BATCH % (dp * micro) == 0)
RULES.rule("tensor parallelism needs a plan", ["model", "tp"], lambda model, tp: tp == "1" or MODELS[model].get("tp", False))
RULES.rule("sequence parallelism needs a final norm", ["model", "tp"],
           lambda model, tp: not tp.endswith("sp") or MODELS[model].get("sp", True))
RULES.rule("a pipeline needs blocks to cut", ["model", "pp"], lambda model, pp: pp == "1" or MODELS[model]["kind"] != "module")
RULES.rule("the schedule's micro-batch count", ["pp", "dp", "micro"], _schedule_ok)
RULES.rule("zero-bubble's weight gradients need the units ZeRO-3 released", ["pp", "strategy"],
           lambda pp, strategy: pp != "zb" or strategy in ("no_shard", "optim", "optim_grads"))
RULES.rule("zero-bubble's second backward through a block", ["pp", "recompute"],
           lambda pp, recompute: pp != "zb" or recompute != "selective")
RULES.rule("a compiled block runs as one op to selective recomputation", ["compile", "recompute"],
           lambda compile, recompute: compile == "off" or recompute != "selective")
RULES.rule("a preference pair in one micro-batch", ["objective", "micro"],
           lambda objective, micro: not pairs(objective) or micro % 2 == 0)

# Where an interaction is known, the configuration is named rather than left to chance.
NAMED = [
    dict(strategy="optim_grads_params", pp="interleaved"),  # ZeRO-3's units gathered per chunk
    dict(strategy="optim_grads", pp="zb"),  # ZB-H1's weight gradients into ZeRO-2's buckets
    dict(tp="2sp", pp="1f1b"),  # sequence shards across stage boundaries
    dict(trainable="lora", objective="dpo"),  # the reference is the base with the adapters off
    dict(trainable="lora", objective="dpo", pp="zb"),  # ... through the stages, the split backward
    dict(strategy="optim_grads_params", recompute="full", tp="2sp"),  # units inside recomputed TP blocks
    dict(objective="dpo-precomputed", pp="1f1b"),  # the reference's table from the stages
    dict(model="gpt", tp="4", strategy="no_shard"),  # tp 4: kv heads and the vocabulary's padding
    dict(model="mixtral", pp="zb", strategy="optim_grads"),  # the router loss through W-split stages
    dict(trainable="frozen", pp="1f1b", model="llama"),  # a frozen tied embedding on both end stages
    dict(model="llama-untied", cp="ulysses", precision="fp32"),  # grouped-query heads split by the all-to-all
    dict(strategy="optim_grads_params", dp=2, cp="ring", precision="fp32"),  # ZeRO-3 over data-parallel x cp ranks
    dict(model="mixtral", ep="2", strategy="optim_grads_params", precision="fp32"),  # experts sharded apart
    dict(model="qwen2_moe", ep="2", strategy="optim", precision="fp32"),  # beside a shared expert
    dict(model="mixtral", ep="2", tp="2sp", precision="fp32"),  # experts whole over tp, each its sequence shard
    # GRPO's weights at world 1 within 1e-5 (fp32) on each layout: 2 x ZeRO-3, tp 2, pp 2, cp 2
    dict(objective="grpo", strategy="optim_grads_params", dp=2, precision="fp32"),
    dict(objective="grpo", tp="2", precision="fp32"),  # the entropy over a split vocabulary
    dict(objective="grpo", pp="1f1b", precision="fp32"),  # old log-probabilities on the last stage
    dict(objective="grpo", cp="ring", precision="fp32"),  # a sequence's mean over its whole row
]

# `compile`: every value of every other axis meets a compiled block in one of these eight full
# configurations, so the fill compiles in no other (left to itself it compiled in 13, each adding
# dynamo's trace of the blocks, again at a resume: ~175 s to the tier; these ~60 s). A search chose
# them for the least compile time: tensor parallelism (its hooks stay eager, so a block compiles
# in pieces), context parallelism and resumes compile most; each model and every other value once.
_C = dict(compile="aot_eager", tp="1", cp="1", ep="1", pp="1", recompute="none", trainable="all", objective="lm",
          precision="fp32", overlap=True, micro=2, resume=False)
COMPILED = [
    {**_C, "model": "gpt", "strategy": "optim_grads", "dp": 1, "cp": "ring", "pp": "1f1b", "objective": "dpo",
     "overlap": False},
    {**_C, "model": "llama", "strategy": "no_shard", "dp": 1, "pp": "gpipe", "trainable": "frozen", "objective": "sft"},
    {**_C, "model": "llama-untied", "strategy": "no_shard", "dp": 1, "tp": "4", "recompute": "every:2",
     "trainable": "frozen", "precision": "bf16"},
    {**_C, "model": "qwen2", "strategy": "hfsdp", "dp": 2, "pp": "interleaved", "recompute": "every:2",
     "trainable": "lora", "objective": "dpo-precomputed", "precision": "bf16"},
    {**_C, "model": "gpt2", "strategy": "optim", "dp": 1, "cp": "ulysses", "pp": "zb", "recompute": "full",
     "trainable": "lora", "overlap": False, "micro": 4},
    {**_C, "model": "module", "strategy": "hsdp", "dp": 2, "recompute": "every:2", "objective": "grpo",
     "precision": "bf16", "resume": True},
    {**_C, "model": "mixtral", "strategy": "no_shard", "dp": 1, "tp": "2", "recompute": "every:2",
     "objective": "own"},
    {**_C, "model": "qwen2_moe", "strategy": "optim_grads_params", "dp": 2, "tp": "2sp", "ep": "2",
     "recompute": "every:2", "precision": "bf16-comm", "micro": 4},
]


def world(c: dict) -> int:
    return c["dp"] * tp_size(c["tp"]) * pp_size(c["pp"]) * cp_size(c["cp"])


def cost(c: dict) -> float:
    """What a (partial) configuration costs to run, roughly: its ranks, half again when resumed."""
    return (c.get("dp", 1) * tp_size(c.get("tp", "1")) * pp_size(c.get("pp", "1")) * cp_size(c.get("cp", "1"))
            * (1.5 if c.get("resume") else 1))


@functools.cache
def configs() -> list[dict]:
    return all_pairs(AXES, RULES, COMPILED + NAMED, cost=cost)


def __getattr__(name: str):
    """`CONFIGS`, generated when first asked for (the pairwise search takes about a second): the
    kept rank processes import this module for its helpers and never ask."""
    if name == "CONFIGS":
        return configs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def label(c: dict) -> str:
    """What a configuration is, as its test id: the model, its strategy and data-parallel size,
    then each axis not at its plainest (e.g. `llama.optim_grads_params.dp2.tp2+sp.full.lora.bf16.micro2`)."""
    parts = [c["model"], c["strategy"], f"dp{c['dp']}"]
    parts += [f"tp{c['tp'].replace('sp', '+sp')}"] if c["tp"] != "1" else []
    parts += [f"pp2-{c['pp']}"] if c["pp"] != "1" else []
    parts += [f"cp2-{c['cp']}"] if c["cp"] != "1" else []
    parts += ["ep2"] if c.get("ep", "1") != "1" else []
    parts += [c["recompute"].replace(":", "")] if c["recompute"] != "none" else []
    parts += [f"compiled-{c['compile']}"] if c.get("compile", "off") != "off" else []
    parts += [c["trainable"]] if c["trainable"] != "all" else []
    parts += [c["objective"]] if c["objective"] != "lm" else []
    parts += [c["precision"]] if c["precision"] != "fp32" else []
    parts += ["no-overlap"] if not c["overlap"] else []
    parts.append(f"micro{c['micro']}")
    parts += ["resume"] if c["resume"] else []
    return ".".join(parts)


def overrides(c: dict, model_keys: list[str], data_kind: str = "text", replay: str | None = None) -> list[str]:
    """The config's keys for configuration `c`, the model given by `model_keys` (`replay`: GRPO's
    recorded completions, `save_rollouts`)."""
    m = MODELS[c["model"]]
    keys = [f"cluster.num_workers={world(c)}", *model_keys, "train.seq_len=32",
            f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={c['micro']}", f"train.steps={STEPS}",
            "train.seed=7", "sharding.bucket_numel=3000", "sharding.shard_align=1",  # several buckets, odd cuts
            "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=1", "optim.weight_decay=0.1",
            "optim.grad_clip=0.01"]  # engaged at every step, by LoRA's adapters too
    if c["strategy"] in HYBRID:
        keys += ["sharding.strategy=optim_grads_params", "sharding.dp_outer=2",
                 f"sharding.outer_strategy={HYBRID[c['strategy']]}"]
    else:
        keys.append(f"sharding.strategy={c['strategy']}")
    if c["tp"] != "1":
        keys.append(f"parallel.tp={tp_size(c['tp'])}")
        keys += ["parallel.sequence_parallel=true"] if c["tp"].endswith("sp") else []
    if c["cp"] != "1":
        keys += ["parallel.cp=2", f"parallel.cp_mode={c['cp']}"]
    if c.get("ep", "1") != "1":
        keys.append("parallel.ep=2")
    keys += [f"moe.router_z_loss={m['z_loss']}"] if "z_loss" in m else []
    if c["pp"] != "1":
        keys += ["parallel.pp=2", f"parallel.pp_schedule={SCHEDULE[c['pp']]}"]
        keys += ["parallel.pp_virtual_stages=2"] if c["pp"] == "interleaved" else []
    keys.append(f"model.activation_checkpointing={c['recompute']}")
    if c.get("compile", "off") != "off":
        keys += ["train.compile=true", f"train.compile_backend={c['compile']}"]
    if c["trainable"] == "lora":
        keys += ["model.lora.r=4", "model.lora.alpha=8"]
        keys += [f"model.lora.target_modules={m['lora']}"] if "lora" in m else []
    elif c["trainable"] == "frozen":
        keys.append(f"model.freeze={m['freeze']}")
    if c["objective"] == "own":
        keys.append("train.objective=tests.own_objective:Weighted")
    if c["objective"] == "grpo":
        from pathlib import Path

        rewards = Path(__file__).resolve().parent / "grpo_rewards.py"
        keys += [*GRPO_KEYS, f"rollout.replay={replay or 'replay.jsonl'}", f"grpo.reward_funcs={rewards}:token_sum"]
    if pairs(c["objective"]):
        keys.append("train.objective=dpo")
        keys += ["dpo.precompute_ref=true"] if c["objective"] == "dpo-precomputed" else []
    if c["precision"] != "fp32":
        keys.append("sharding.param_dtype=bf16")
        keys += ["sharding.comm_dtype=bf16"] if c["precision"] == "bf16-comm" else []
    if not c["overlap"]:
        keys += ["sharding.overlap_grad_reduce=false", "sharding.overlap_param_gather=false"]
    if world(c) > 2:
        keys.append("cluster.cpus_per_worker=0.5")
    return keys


def save_models(root) -> dict[str, str]:
    """The HF models' directories (`save_pretrained`, 4 decoder layers each), by name."""
    from tests.models import save_hf_model

    dirs = {}
    for i, (name, m) in enumerate(MODELS.items()):
        if m["kind"] != "hf":
            continue
        shape = dict(n_layer=4) if m["arch"] == "gpt2" else dict(num_hidden_layers=4)
        extra = {k: m[k] for k in ("num_key_value_heads",) if k in m}
        if "vocab" in m:
            extra["vocab_size"] = m["vocab"]
        dirs[name] = str(save_hf_model(m["arch"], root / name, seed=i, **shape, **extra))
    return dirs


def save_rollouts(root, tokenizer) -> tuple[str, str]:
    """GRPO's data: prompts of a word or two prepared (`--prompts`), and (the replay file) their
    completions for every round of `STEPS` steps, 2 prompts x GRPO_G a round, of 1 to
    GRPO_COMPLETION tokens drawn from a seeded generator, some ended by the end-of-sequence id."""
    import json
    import random

    from rayzero.data.tokenizer import load_tokenizer
    from rayzero.data.tokens import prepare

    words = ["red", "blue", "two plus", "the sky", "green grass", "what is", "four", "seven"]
    prompts = [{"prompt": f"Q: {w}?"} for w in words]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    prepare(root / "prompts.jsonl", str(root / "prompts"), tokenizer=str(tokenizer), prompts=True)
    eos = load_tokenizer(str(tokenizer)).eos_id
    rng, lines = random.Random(11), []
    for r in range((STEPS - 1) // 2 + 1):
        for p in prompts[2 * r: 2 * r + 2]:
            for i in range(GRPO_G):
                n = rng.randint(1, GRPO_COMPLETION)
                ids = [rng.randrange(3, 250) for _ in range(n)]
                ids[-1] = eos if n < GRPO_COMPLETION and rng.random() < 0.7 else ids[-1]
                lines.append({"round": r, "prompt": p["prompt"], "index": i, "completion_ids": ids})
    (root / "replay.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(root / "prompts"), str(root / "replay.jsonl")


def rollout_plans(cfg, data: str) -> list[dict] | None:
    """Each step's rollouts ({"step", "rows"}) as the driver's side makes them for the plan
    (`Rollouts.plan`, the replay engine), or None for an objective that does not sample."""
    if cfg.train.objective != "grpo":
        return None
    from rayzero.jobs.rollouts import rollouts_for
    from rayzero.workers.assembly import make_spec

    side = rollouts_for(cfg, data, make_spec(cfg))
    side.check(STEPS)
    return [side.plan(k, None) for k in range(STEPS)]


def model_keys(name: str, dirs: dict[str, str]) -> list[str]:
    """The config's keys for model `name` (`dirs`: the HF models' directories, `save_models`)."""
    m = MODELS[name]
    if m["kind"] == "gpt":
        return ["model.n_layer=4", "model.n_embd=32", "model.n_head=4", "model.bias=true", "model.vocab_size=259"]
    if m["kind"] == "module":
        return ["model.kind=module", "model.factory=tests.models:TinyLM", "model.kwargs.n_layer=4"]
    return ["model.kind=hf", f"model.path={dirs[name]}"]


def rank_identity(cfg, rank: int) -> dict:
    """What rank `rank` of a run of `cfg` reports of its model (`assembly.identity`: whole
    shapes, frozen names, the model's record), assembled on the meta device as the rank
    assembles it without a group: the steps before sharding, then its pipeline stage."""
    from rayzero.workers.assembly import build_model, identity, make_spec, pipeline_stage

    spec = make_spec(cfg)
    mesh = cfg.mesh(rank=rank)
    built = build_model(cfg, spec, mesh)
    pipeline_stage(built, cfg, spec, mesh)
    return {**identity(built.model, built.tp, spec), "pp_rank": mesh.coord("pp"), "pp": mesh.size("pp")}


def stage_ranks(cfg) -> list[int]:
    """One rank of each pipeline stage, the lowest: the ranks whose reports a checkpoint keeps
    (`stages.whole_build`; the ranks of one stage report the same whole shapes at any dp and tp)."""
    firsts: dict[int, int] = {}
    for r in range(cfg.cluster.num_workers):
        firsts.setdefault(cfg.mesh(rank=r).coord("pp"), r)
    return sorted(firsts.values())


def commit_on_meta(cfg, infos: list[dict], step: int = SAVE_AT) -> str:
    """The step-`step` checkpoint of ranks that reported `infos` (`rank_identity`), committed by
    `Checkpoints` as the controller commits one; its shards are empty files (no tensor is read
    by what is tested with it: where a run resumes, and what it refuses)."""
    from rayzero.cluster.checkpoints import Checkpoints

    ckpt = Checkpoints(cfg)
    ckpt.configure([{**i, "rank": r, "saves_shard": True, "layout": {}, "num_params": 0, "trainable_params": 0,
                     "flops_per_token": 0.0, "params_per_rank": 0} for r, i in enumerate(infos)], mlflow_run_id=None)
    step_dir = ckpt.root.child(f"step-{step:06d}")
    uploads = []
    for r, i in enumerate(infos):
        name = f"shard-{r:05d}.safetensors"
        step_dir.write_bytes(name, b"")
        uploads.append({"step": step, "rank": r, "tp_rank": 0, "file": name, "size": 0, "block": None,
                        "sha256": "", "pieces": [], "pp_rank": i["pp_rank"], "adam_steps": step})
    ckpt.collect(step - 1, [{"checkpointed": True, "loss_scale": 1.0, "lr": 1e-3, "uploads": []}])
    ckpt.add_uploads(uploads)
    assert ckpt.last_committed, "the checkpoint must commit"
    return ckpt.last_committed


def covered_pairs() -> int:
    from tests.allpairs import pairs_of

    return len(set().union(*(pairs_of(c, list(AXES)) for c in configs())))


def excluded_pairs() -> list:
    return infeasible_pairs(AXES, RULES)


def readme_block() -> str:
    """What docs/concepts/tests.md says of the configurations (kept equal to this by
    tests/unit/test_allpairs.py; `python -m tests.combinations` prints it)."""
    from itertools import combinations

    names = list(AXES)
    total = sum(len(AXES[a]) * len(AXES[b]) for a, b in combinations(names, 2))
    excluded = excluded_pairs()
    product = 1
    for values in AXES.values():
        product *= len(values)
    lines = [f"{len(configs())} configurations ({sum(world(c) == 4 for c in configs())} at 4 ranks, the rest at 2) "
             f"of a product of {product:,} cover all {covered_pairs()} pairs of values the product allows "
             f"(of {total}; the {len(excluded)} left out break a rule, each a refusal of the product's own):", ""]
    lines += [f"- `{axis}`: {', '.join(f'`{v}`' for v in values)}" for axis, values in AXES.items()]
    lines += ["", "and these named interactions, each in at least one configuration:", ""]
    lines += ["- " + " × ".join(f"`{k}={v}`" for k, v in named.items()) for named in NAMED]
    lines += ["", "Blocks are compiled (`compile=aot_eager`) in these eight only, which meet every other value:", ""]
    lines += [f"- `{label(c)}`" for c in COMPILED]
    return "\n".join(lines)


if __name__ == "__main__":
    print(readme_block())
