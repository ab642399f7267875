"""Long-tail completions: one generation round through the transformers engine, a group at a
time (`rollout.slots=0`) against a continuous batch (`rollout.slots=S`), beside transformers'
`generate` over the whole round as one padded batch (static batching, as TRL's `GRPOTrainer`
generates without vLLM), in alternating rounds.

The round: 16 prompts (12 to 20 tokens) x 8 completions, up to `--max-tokens` tokens each,
from a Llama of 4 layers of width 256 (random weights) whose completions end at 1 in 32 of its
ids, so that a completion ends after 32 tokens on average but one in a group often runs to the
limit: the long tail. All three draw from the same distribution (temperature 1); what each
finishes is not the same completions, so the figure is the round's time and the completion
tokens a second. One process, 2 torch threads.

    python benchmarks/long_tail.py [--rounds 3] [--slots 16 64] [--max-tokens 128] [--json PATH]

Prints each arm's round time (median over rounds), tokens a second, the decode steps it took
(forward passes after the prompts'), and each over the group-at-a-time arm as a ratio (below 1:
faster).

    python benchmarks/long_tail.py --chain 4 [--slots 16 64] [--json PATH]

One rollout actor's rounds one after another through a continuous batch of each `--slots` rows, as
`rollout.partial` runs them: `finish` (each round's batch runs until its last completion ends,
its free rows idle meanwhile), against `continue` and `restart` (what is still sampling once a
row would be idle is handed on to the next round's batch; the last round's handed-on rows
finished by a batch of their own, so every arm samples every round whole). Prints each arm's
time for the rounds, its decode steps, how full its rows were, the completion tokens it kept
and sampled, and each over `finish` at the same rows as a ratio. On a GPU a decode step costs about the same
with any number of rows (memory-bound), so the steps are the figure that carries over; on 2 CPU
cores a step's time grows with its rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PROMPTS, GROUP, VOCAB = 16, 8, 512


def setup(max_tokens: int):
    import transformers as tf

    from rayzero.rollout.engines import Sampling, TransformersEngine, draw_seed

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                            tie_word_embeddings=True)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    stops = tuple(range(0, VOCAB, 32))  # 1 in 32 ids ends a completion
    engine = TransformersEngine(model, stops)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(40, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(12, 21, (PROMPTS,), generator=gen)]
    groups = [(p, [draw_seed(0, 0, k, i) for i in range(GROUP)]) for k, p in enumerate(prompts)]
    return model, engine, groups, Sampling(max_completion_length=max_tokens), stops


def by_groups(engine, groups, sampling) -> dict:
    t0 = time.perf_counter()
    got = engine.groups(groups, sampling, 0)
    seconds = time.perf_counter() - t0
    steps = sum(max(len(c.ids) for c in g) - 1 for g in got)
    return {"seconds": seconds, "tokens": sum(len(c.ids) for g in got for c in g), "steps": steps}


def continuous(engine, groups, sampling, slots: int) -> dict:
    from rayzero.rollout.continuous import ContinuousBatch

    batch = ContinuousBatch(engine, slots)
    t0 = time.perf_counter()
    got = batch.run(groups, sampling)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(len(c.ids) for g in got for c in g), "steps": batch.forwards}


def static(model, groups, sampling, stops) -> dict:
    """transformers' `generate` over the round as one left-padded batch, every row until the
    longest ends; tokens counted up to each row's end id."""
    rows = [p for p, seeds in groups for _ in seeds]
    width = max(map(len, rows))
    pad = stops[0]
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=sampling.max_completion_length, eos_token_id=list(stops),
                             pad_token_id=pad)
    seconds = time.perf_counter() - t0
    new = out[:, width:].tolist()
    tokens = sum(next((k + 1 for k, t in enumerate(r) if t in stops), len(r)) for r in new)
    return {"seconds": seconds, "tokens": tokens, "steps": out.shape[1] - width - 1}


def chain(engine, prompts: list, sampling, slots: int, rounds: int, partial: str) -> dict:
    """`rounds` rounds of one actor's share through batches of `slots` rows (see the module's doc)."""
    from rayzero.rollout.continuous import ContinuousBatch
    from rayzero.rollout.engines import draw_seed

    steps = rows = kept = dropped = 0
    handed: list[dict] = []
    t0 = time.perf_counter()
    for r in range(rounds + 1):  # the last: the rows the last round handed on, finished
        groups = [(p, [draw_seed(0, r, k, i) for i in range(GROUP)]) for k, p in enumerate(prompts)] if r < rounds \
            else []
        batch, finished = ContinuousBatch(engine, slots), []
        got = batch.run(groups, sampling, handed, partial != "finish" and r < rounds, r,
                        "continue" if partial == "finish" else partial, finished.extend)
        kept += sum(len(c.ids) for g in got for c in g if c is not None) + sum(len(c.ids) for c in finished)
        dropped += sum(len(h["ids"]) for h in handed) if partial == "restart" else 0  # sampled again from the start
        handed = batch.handed_on
        steps += batch.forwards
        rows += sum(w for w, _ in batch.widths)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "steps": steps, "occupancy": rows / max(1, steps * slots), "tokens": kept,
            "sampled": kept + dropped}


def main_chain(args, engine, groups, sampling) -> None:
    prompts = [p for p, _ in groups]
    chain(engine, prompts[:4], sampling, args.slots[0], 1, "continue")  # warm-up, not counted
    result = {"prompts": PROMPTS, "group": GROUP, "max_tokens": args.max_tokens, "rounds": args.chain,
              "slots": args.slots, "arms": {}}
    for slots in args.slots:
        for partial in ("finish", "continue", "restart"):
            x = {"partial": partial, "slots": slots, **chain(engine, prompts, sampling, slots, args.chain, partial)}
            result["arms"][f"{partial}, {slots} rows"] = x
            base = result["arms"][f"finish, {slots} rows"]
            x["over_finish"] = {"seconds": x["seconds"] / base["seconds"], "steps": x["steps"] / base["steps"]}
            over = x["over_finish"]
            print(f"{partial}, {slots} rows: {x['seconds']:.2f} s for {args.chain} rounds ({over['seconds']:.2f}x "
                  f"finish's), {x['steps']} steps ({x['over_finish']['steps']:.2f}x), rows {x['occupancy']:.0%} full, "
                  f"{x['tokens']} tokens kept of {x['sampled']} sampled", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slots", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--chain", type=int, default=0, help="rounds of one actor as rollout.partial runs them")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, engine, groups, sampling, stops = setup(args.max_tokens)
    if args.chain:
        return main_chain(args, engine, groups, sampling)
    arms = {"a group at a time": lambda: by_groups(engine, groups, sampling),
            **{f"continuous, {s} rows": (lambda s=s: continuous(engine, groups, sampling, s)) for s in args.slots},
            "generate, one padded batch": lambda: static(model, groups, sampling, stops)}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for name, arm in arms.items():  # a round each first, not counted: allocator and thread pools warmed
        arm()
    for r in range(args.rounds):
        for name, arm in arms.items():
            runs[name].append(arm())
            x = runs[name][-1]
            print(f"round {r}: {name}: {x['seconds']:.2f} s, {x['tokens']} tokens, {x['steps']} steps", flush=True)
    base = statistics.median(x["seconds"] for x in runs["a group at a time"])
    result = {"prompts": PROMPTS, "group": GROUP, "max_tokens": args.max_tokens, "rounds": args.rounds, "arms": {}}
    for name, xs in runs.items():
        seconds = statistics.median(x["seconds"] for x in xs)
        result["arms"][name] = {"seconds": seconds, "tokens_per_s": statistics.median(x["tokens"] / x["seconds"]
                                                                                      for x in xs),
                                "tokens": statistics.median(x["tokens"] for x in xs),
                                "steps": statistics.median(x["steps"] for x in xs), "over_groups": seconds / base}
        a = result["arms"][name]
        print(f"{name}: {a['seconds']:.2f} s a round, {a['tokens_per_s']:.0f} tokens/s, {a['steps']:.0f} steps, "
              f"{a['over_groups']:.2f}x a group at a time's time")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
