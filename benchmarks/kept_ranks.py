"""A run's time in a process that ran one before: new rank processes against kept ones.

`cluster.keep_ranks=true` keeps a finished run's rank processes for the next run of the same
Python process placed alike (a notebook's next `fit()`, a sweep, the end-to-end tests). This
runs `rayzero train` by the CLI's `main` in this process, joining a Ray head it starts
(`startup.start_head`: this machine's CPUs, token auth), in rounds; each round, per model (the built-in GPT and a tiny Llama saved
by `examples/tiny_llama.py`): one run without keeping (new processes: Ray's worker start, torch
and the model's code imported), then two with keeping, of which the second is timed (it takes
the first's ranks). Each run trains 4 steps on 2 ranks, MLflow and checkpoints off. A third
model is online RL: the GRPO guide's task (`examples/grpo_task.py`, a tiny Llama) on 2 ranks of
half a CPU and one rollout actor, whose process is kept beside the ranks. Reported: the median
seconds of each, and kept / new.

    python benchmarks/kept_ranks.py [--rounds 3] [--json PATH]
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

from startup import start_head  # benchmarks/startup.py: a head as a running cluster has one

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
RUN = ["train", "--no-progress", "train.steps=4", "tracking.enabled=false", "checkpoint.dir=", "cluster.num_workers=2"]


def timed(main, argv: list[str]) -> float:
    started = time.perf_counter()
    code = main(argv)
    if code != 0:
        raise SystemExit(f"rayzero {' '.join(argv)} exited {code}")
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kept-ranks-"))
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    os.environ["RAY_AUTH_MODE"] = "token"
    subprocess.run([str(BIN / "python"), str(HERE.parent / "examples/tiny_llama.py"), str(work / "llama")],
                   check=True, capture_output=True)
    from grpo import task  # benchmarks/grpo.py: the guide's task, its prompts prepared

    rl = task(work / "grpo")
    address, _ = start_head(env)
    from rayzero import release_ranks
    from rayzero.jobs.cli import main as rayzero

    models = {"gpt": [], "llama": ["model.kind=hf", f"model.path={work / 'llama'}"],
              "grpo": ["model.kind=hf", f"model.path={rl / 'model'}", f"data.path={rl / 'data'}",
                       "train.objective=grpo", f"grpo.reward_funcs={rl / 'reward.py'}:says_it",
                       "grpo.num_generations=8", "grpo.max_completion_length=4", "train.global_batch_size=32",
                       "train.micro_batch_size=8", "train.seq_len=16", "cluster.cpus_per_worker=0.5",
                       "rollout.cpus_per_worker=1"]}
    times: dict[str, dict[str, list[float]]] = {m: {"new": [], "kept": []} for m in models}
    try:
        base = [*RUN, f"cluster.address={address}", f"train.output_dir={work / 'runs'}"]
        for m, keys in models.items():  # untimed: the page cache, this process's own imports
            timed(rayzero, [*base, *keys])
        for r in range(args.rounds):
            for m, keys in models.items():
                times[m]["new"].append(timed(rayzero, [*base, *keys]))
                timed(rayzero, [*base, *keys, "cluster.keep_ranks=true"])
                times[m]["kept"].append(timed(rayzero, [*base, *keys, "cluster.keep_ranks=true"]))
                release_ranks()
                print(f"round {r + 1}: {m} new {times[m]['new'][-1]:.2f} s, kept {times[m]['kept'][-1]:.2f} s",
                      file=sys.stderr)
    finally:
        release_ranks()
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True)
    result = {}
    print("| model, 4 steps on 2 ranks | new processes (s) | kept processes (s) | kept / new |\n|---|---|---|---|")
    for m, t in times.items():
        new, kept = statistics.median(t["new"]), statistics.median(t["kept"])
        result[m] = {"new_s": new, "kept_s": kept, "ratio": kept / new, "rounds": t}
        print(f"| {m} | {new:.2f} | {kept:.2f} | {kept / new:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
