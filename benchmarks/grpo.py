"""What an online-RL step costs: rayzero's GRPO on the guide's task (a tiny Llama learning to say
back a digit, `examples/grpo_task.py`) against TRL's `GRPOTrainer` on the same model, prompts,
reward and settings, in alternating rounds.

    rayzero   `rayzero train` as the guide runs it: 2 ranks (0.5 CPU each) and one rollout actor
              (1 CPU) sampling with transformers and a KV cache; each step's time from its
              history (`step_ms`), split into generate, score, sync and the rest (the ranks'
              update, the plan, the driver)
    TRL       `GRPOTrainer` in one process (2 torch threads), generating with transformers'
              `generate`; each step's time from a callback at the step's begin and end

Both: 8 completions for each of 4 prompts a step (32), up to 4 tokens each, lr 3e-3 constant,
beta 0, one optimizer step per generation. The first `--skip` steps of each run (imports,
allocator warm-up, the first sync) are left out of the medians.

    python benchmarks/grpo.py [--rounds 2] [--steps 12] [--skip 3] [--json PATH]
    python benchmarks/grpo.py --lag 1 [--rounds 2] [--steps 12]
    python benchmarks/grpo.py --mismatch [--seeds 3]

Prints each side's median step time, rayzero's split, completion tokens a second, and
rayzero / TRL as a ratio of step times (below 1: rayzero is faster).

With `--lag K`: generation overlapped with training (`rollout.max_lag=K`) against the
synchronous run (lag 0), in alternating rounds, on a larger Llama (4 layers of width 256, 32
completions of 24 tokens a step), with two engines: one whose generation is a wait rather than
CPU work (`benchmarks/engines.py`: what a GPU engine is to the host) and the real CPU
engine, which competes with the ranks for the same 2 cores. Prints each engine's generate,
update, sync and score times at lag 0, the step at lag 0 and at lag K, and the step at lag K
over max(generate, update) + sync + score and over max(generate, update + sync + score) (the
sync overlapping generation too: the actors stage new weights while they generate).

With `--mismatch`: the guide's task with a sampler that disagrees with the trainer (it samples
at 1.6 times the temperature: `benchmarks/engines.py:HotEngine`), without a correction and with
token-level truncated importance sampling, against the run's own sampler, over `--seeds` seeds:
the reward each ends at and the mismatch it logs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
G, PROMPTS, COMPLETION, LR = 8, 4, 4, 3e-3


def task(work: Path) -> Path:
    """The guide's task written and its prompts prepared under `work`."""
    subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_task.py"), str(work)], check=True,
                   capture_output=True)
    from rayzero.data.tokens import prepare

    prepare(work / "prompts.jsonl", str(work / "data"), tokenizer=str(work / "model"), prompts=True)
    return work


def rayzero_run(work: Path, steps: int, address: str, out: Path, model: str = "model", extra: tuple = (),
                completion: int = COMPLETION, seq_len: int = 16) -> list[dict]:
    """One `rayzero train` of the guide's command (`steps` steps; `extra` keys after it): its history's rows."""
    cmd = [str(BIN / "rayzero"), "train", "--no-progress", "--summary-json", str(out / "s.json"),
           f"cluster.address={address}", "model.kind=hf", f"model.path={work / model}",
           f"data.path={work / 'data'}", "train.objective=grpo", f"grpo.reward_funcs={work / 'reward.py'}:says_it",
           f"grpo.num_generations={G}", f"grpo.max_completion_length={completion}",
           f"train.global_batch_size={G * PROMPTS}", "train.micro_batch_size=8", f"train.seq_len={seq_len}",
           f"optim.lr={LR}", "optim.schedule=constant", "optim.warmup_steps=0", f"train.steps={steps}",
           "cluster.num_workers=2", "cluster.cpus_per_worker=0.5", "rollout.cpus_per_worker=1", "checkpoint.dir=",
           "tracking.enabled=false", f"train.output_dir={out / 'runs'}", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if done.returncode != 0:
        raise SystemExit(f"rayzero train failed:\n{done.stderr[-3000:]}")
    from rayzero.cluster.history import load_rows

    summary = json.loads((out / "s.json").read_text())
    return load_rows(Path(summary["run_dir"]) / "history.jsonl")


def trl_arm(work: Path, steps: int, out: Path) -> None:
    """TRL's side, in a process of its own (`--trl-arm`): per-step seconds and logs into `out`."""
    import datasets
    import torch
    import transformers
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    sys.path.insert(0, str(work))
    from reward import says_it

    tok = AutoTokenizer.from_pretrained(str(work / "model"))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    records = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    args = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, bf16=False, learning_rate=LR,
                      lr_scheduler_type="constant", warmup_steps=0, per_device_train_batch_size=G * PROMPTS,
                      gradient_accumulation_steps=1, max_steps=steps, num_generations=G,
                      max_completion_length=COMPLETION, steps_per_generation=1, beta=0.0, logging_steps=1,
                      save_strategy="no", report_to=[], disable_tqdm=True, log_completions=False,
                      model_init_kwargs={"dtype": "float32"})
    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=[says_it], args=args,
                          train_dataset=datasets.Dataset.from_list(records * 50), processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    (out / "trl.json").write_text(json.dumps({"step_s": times, "logs": logs}))


def trl_run(work: Path, steps: int, out: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--trl-arm", str(work), "--steps", str(steps), "--out", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL's run failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "trl.json").read_text())


BIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
LAG_COMPLETION, LAG_SEQ = 24, 32


def big_model(work: Path) -> str:
    """The guide's tokenizer and prompts with a larger Llama (4 layers of width 256), whose update
    takes about as long as the waiting engine's generation."""
    import shutil

    import transformers as tf

    src, dst = work / "model", work / "model-big"
    if not dst.exists():
        config = tf.AutoConfig.from_pretrained(src)
        for k, v in BIG.items():
            setattr(config, k, v)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(dst)
        for f in src.glob("tokenizer*"):
            shutil.copy(f, dst / f.name)
    return "model-big"


def lag_rounds(work: Path, address: str, root: Path, args) -> dict:
    """Lag 0 against lag k, each with the waiting engine and with the real (CPU) engine, in
    alternating rounds: each step's time, its parts, and max(generate, update) + sync + score
    against the step measured at lag k."""
    model = big_model(work)
    engines = {"waiting": [f"rollout.engine={Path(__file__).resolve().parent / 'engines.py'}:WaitingEngine"],
               "transformers": []}
    runs: dict = {(e, k): [] for e in engines for k in (0, args.lag)}
    for r in range(args.rounds):
        for (engine, k) in runs:
            out = root / f"lag-{engine}-{k}-{r}"
            out.mkdir()
            rows = rayzero_run(work, args.steps, address, out, model, (*engines[engine], f"rollout.max_lag={k}"),
                               LAG_COMPLETION, LAG_SEQ)
            runs[(engine, k)] += rows[args.skip:]
            print(f"round {r + 1}: {engine} engine, lag {k}: "
                  f"{statistics.median(x['step_ms'] for x in rows[args.skip:]):.0f} ms a step", file=sys.stderr)

    def med(rows, key):
        return statistics.median(x.get(key, 0.0) for x in rows)

    result = {}
    for engine in engines:
        sync0, lagged = runs[(engine, 0)], runs[(engine, args.lag)]
        gen, sync, score = med(sync0, "generate_ms"), med(sync0, "sync_ms"), med(sync0, "score_ms")
        update = statistics.median(x["step_ms"] - x.get("wait_ms", 0) - x.get("score_ms", 0) - x.get("sync_ms", 0)
                                   for x in sync0)
        step0, stepk = med(sync0, "step_ms"), med(lagged, "step_ms")
        bound = max(gen, update) + sync + score
        hidden = max(gen, update + sync + score)  # the sync too overlapping generation (the actors stage it)
        result[engine] = {"generate_ms": gen, "update_ms": update, "sync_ms": sync, "score_ms": score,
                          "step_lag0_ms": step0, f"step_lag{args.lag}_ms": stepk, "bound_ms": bound,
                          "overlap_bound_ms": hidden, "step_over_overlap_bound": stepk / hidden,
                          "sum_ms": gen + update + sync + score, "step_over_bound": stepk / bound,
                          "speedup": step0 / stepk,
                          "generate_lagged_ms": med(lagged, "generate_ms"), "update_lagged_ms": statistics.median(
                              x["step_ms"] - x.get("wait_ms", 0) - x.get("score_ms", 0) - x.get("sync_ms", 0)
                              for x in lagged)}
    print(f"| lag {args.lag} against 0 (4 layers of width 256, {G * PROMPTS} completions of {LAG_COMPLETION} tokens) | "
          "generate | update | sync + score | step at lag 0 | max(generate, update) + sync + score | "
          "max(generate, update + sync + score) | "
          f"step at lag {args.lag} | lag {args.lag} / each | speedup |\n|---|---|---|---|---|---|---|---|---|---|")
    for engine, x in result.items():
        print(f"| {engine} engine | {x['generate_ms']:.0f} ms | {x['update_ms']:.0f} ms | "
              f"{x['sync_ms'] + x['score_ms']:.0f} ms | {x['step_lag0_ms']:.0f} ms | {x['bound_ms']:.0f} ms | "
              f"{x['overlap_bound_ms']:.0f} ms | {x[f'step_lag{args.lag}_ms']:.0f} ms | "
              f"{x['step_over_bound']:.2f}×, {x['step_over_overlap_bound']:.2f}× | {x['speedup']:.2f}× |")
    return {"lag": args.lag, "engines": result,
            "settings": {"completion": LAG_COMPLETION, "seq_len": LAG_SEQ, "model": BIG, "steps": args.steps,
                         "skipped": args.skip, "rounds": args.rounds}}


def mismatch_runs(work: Path, address: str, root: Path, args) -> dict:
    """The guide's task (60 steps, seeds 0..seeds-1) with its own sampler, and with a sampler
    hotter than the trainer (`benchmarks/engines.py:HotEngine`) without a correction and with
    token-level truncated importance sampling: the mismatch each shows, and the reward it ends
    at (the mean over its last 10 steps)."""
    hot = [f"rollout.engine={Path(__file__).resolve().parent / 'engines.py'}:HotEngine"]
    arms = {"own sampler": [], "hotter sampler": hot, "hotter sampler + token_truncate":
            [*hot, "rollout.is_correction=token_truncate"]}
    result: dict = {}
    for name, keys in arms.items():
        finals, kls, diffs = [], [], []
        for seed in range(args.seeds):
            out = root / f"mismatch-{len(result)}-{seed}"
            out.mkdir()
            rows = rayzero_run(work, 60, address, out, extra=(*keys, f"train.seed={seed}"))
            finals.append(statistics.mean(x["reward"] for x in rows[-10:]))
            kls.append(statistics.mean(x["sampling/kl"] for x in rows))
            diffs.append(max(x["sampling/sampling_logp_difference/max"] for x in rows))
            print(f"{name}, seed {seed}: reward {finals[-1]:.3f}, sampling/kl {kls[-1]:.4f}", file=sys.stderr)
        result[name] = {"final_rewards": finals, "mean": statistics.mean(finals), "min": min(finals),
                        "max": max(finals), "sampling_kl": statistics.mean(kls), "logp_difference_max": max(diffs)}
    print("| the guide's task, 60 steps | reward over the last 10 steps (mean, min–max over seeds) | sampling/kl | "
          "largest logp difference |\n|---|---|---|---|")
    for name, x in result.items():
        print(f"| {name} | {x['mean']:.3f} ({x['min']:.3f}–{x['max']:.3f}) | {x['sampling_kl']:.4f} | "
              f"{x['logp_difference_max']:.2f} |")
    return {"arms": result, "seeds": args.seeds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--lag", type=int, default=0, help="compare generation overlapped at this lag with lag 0 "
                    "(instead of rayzero with TRL)")
    ap.add_argument("--mismatch", action="store_true", help="a sampler hotter than the trainer, with and "
                    "without importance sampling, against the run's own sampler")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--trl-arm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_arm:
        return trl_arm(Path(args.trl_arm), args.steps, Path(args.out))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from startup import start_head  # a Ray head, as a running cluster has one

    root = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    work = task(root / "task")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    os.environ["RAY_AUTH_MODE"] = "token"
    address, _ = start_head(env)
    try:
        run = mismatch_runs if args.mismatch else lag_rounds if args.lag else vs_trl
        result = run(work, address, root, args)
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def vs_trl(work: Path, address: str, root: Path, args) -> dict:
    """rayzero and TRL in alternating rounds on the guide's task."""
    ours: list[dict] = []
    theirs: list[float] = []
    trl_lengths: list[float] = []
    for r in range(args.rounds):
        out = root / f"round{r}"
        out.mkdir()
        rows = rayzero_run(work, args.steps, address, out)[args.skip:]
        ours += rows
        got = trl_run(work, args.steps, out)
        theirs += got["step_s"][args.skip:]
        trl_lengths += [e["completions/mean_length"] for e in got["logs"][args.skip:]
                        if "completions/mean_length" in e]
        print(f"round {r + 1}: rayzero {statistics.median(x['step_ms'] for x in rows):.0f} ms, "
              f"TRL {statistics.median(got['step_s'][args.skip:]) * 1e3:.0f} ms a step", file=sys.stderr)

    def med(key: str) -> float:
        return statistics.median(x.get(key, 0.0) for x in ours)

    step, trl_step = med("step_ms"), statistics.median(theirs) * 1e3
    split = {k: med(f"{k}_ms") for k in ("generate", "score", "sync")}
    split["update and the rest"] = statistics.median(
        x["step_ms"] - sum(x.get(f"{k}_ms", 0.0) for k in ("generate", "score", "sync")) for x in ours)
    tokens = G * PROMPTS * med("completions/mean_length")
    trl_tokens = G * PROMPTS * (statistics.median(trl_lengths) if trl_lengths else float("nan"))
    result = {"rayzero_step_ms": step, "trl_step_ms": trl_step, "ratio": step / trl_step, "split_ms": split,
              "rayzero_completion_tokens_per_s": tokens / step * 1e3,
              "trl_completion_tokens_per_s": trl_tokens / trl_step * 1e3,
              "settings": {"prompts": PROMPTS, "num_generations": G, "max_completion_length": COMPLETION,
                           "steps": args.steps, "skipped": args.skip, "rounds": args.rounds}}
    print("| GRPO step, guide's task | rayzero (2 ranks + 1 rollout actor) | TRL (one process) |\n|---|---|---|")
    print(f"| step (median) | {step:.0f} ms | {trl_step:.0f} ms |")
    print(f"| completion tokens / s | {result['rayzero_completion_tokens_per_s']:.0f} | "
          f"{result['trl_completion_tokens_per_s']:.0f} |")
    print(f"\nrayzero / TRL step time: {result['ratio']:.2f}x; rayzero's step: "
          + ", ".join(f"{k} {v:.0f} ms" for k, v in split.items()))
    return result


if __name__ == "__main__":
    main()
