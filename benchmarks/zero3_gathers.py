"""What ZeRO-3 gathers a step: the all-gathers of parameter buckets a rank starts, and the bytes it
receives by them, in forward and in backward, counted (not timed) on real gloo groups.

Two ranks (plain processes, the `Rank` a run's actors host) train a few iterations of
`optim_grads_params` with 4 micro-batches a rank; the last iteration is counted by wrapping
`Axis.start_all_gather`, split by the phase that started each gather. Models:

    gpt     the built-in GPT (`small`: 10.8M parameters, 6 blocks, the corpus's vocabulary of 320,
            tied head)
    llama   the tests' untied HF Llama (`tests/models.py`, `save_pretrained`) at 4 decoder layers
            of width 256 and a vocabulary of 32,000: the shape of a real one's embedding share

With `--before REF` the same runs again with rayzero as git revision REF had it (a `git worktree`,
removed at the end),
side by side. Counts do not depend on the machine's speed. Each run then times `--timed`
iterations more (the median, in ms), the runs of a model alternating over `--rounds`, and each
tree's time is given as the median over rounds of its ratio to the first tree's.

    python benchmarks/zero3_gathers.py [--models gpt llama] [--before REF] [--rounds 2] [--timed 8]
                                       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
ROOT = Path(__file__).resolve().parent.parent
WORLD, MICRO, STEPS = 2, 4, 3


def _rank(rank: int, tree: str | None, overrides: list[str], data: str, port: int, timed: int, out) -> None:
    if tree is not None:  # rayzero as another revision has it: its package ahead of the installed one
        sys.path.insert(0, tree)
    from rayzero.config import load_config
    from rayzero.sharding.comm import Axis
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    cfg = load_config(None, [*overrides, f"cluster.num_workers={WORLD}", "sharding.strategy=optim_grads_params",
                             "train.micro_batch_size=1", f"train.global_batch_size={WORLD * MICRO}",
                             "train.seq_len=128", f"train.steps={STEPS + timed}"])
    r = Rank(cfg, rank, WORLD, data)
    r.setup("127.0.0.1", port)
    for k in range(STEPS - 1):
        r.iteration({"step": k, "lr": 1e-3})
    phase, counts = ["other"], {}
    start = Axis.start_all_gather

    def counted(self, full, local):
        n, b = counts.get(phase[0], (0, 0))
        counts[phase[0]] = (n + 1, b + (full.numel() - local.numel()) * full.element_size())
        return start(self, full, local)

    def in_phase(name: str, method):
        def run(*args, **kwargs):
            phase[0] = name
            try:
                return method(*args, **kwargs)
            finally:
                phase[0] = "other"
        return run

    Axis.start_all_gather = counted
    for name in ("forward", "backward"):
        setattr(r, name, in_phase(name, getattr(r, name)))
    r.iteration({"step": STEPS - 1, "lr": 1e-3})
    Axis.start_all_gather = start
    times = []
    for k in range(STEPS, STEPS + timed):
        t0 = time.perf_counter()
        r.iteration({"step": k, "lr": 1e-3})
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out["counts"] = counts
        out["ms"] = statistics.median(times) * 1e3 if times else float("nan")
        out["params"] = sum(p.numel() for p in r.model.parameters())
    r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    ap.add_argument("--before", metavar="REF", help="also count rayzero as git revision REF had it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timed", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    from rank_step import worktree

    from rayzero.data.corpus import ensure_default_corpus
    from tests.conftest import free_port
    from tests.models import save_hf_model

    data = ensure_default_corpus("~/.cache/rayzero/datasets")
    tmp = Path(tempfile.mkdtemp())
    models = {"gpt": ["model.preset=small"], "llama": ["model.kind=hf", f"model.path={tmp / 'llama'}"]}
    if "llama" in args.models:  # the tests' untied Llama, at a real one's embedding share
        save_hf_model("llama-untied", tmp / "llama", vocab_size=32000, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=4, max_position_embeddings=256)
    trees = {"now": None, **({f"@{args.before}": worktree(args.before, tmp / "before")} if args.before else {})}
    rows: dict[str, dict] = {}
    try:
        with mp.Manager() as manager:
            for model in args.models:
                labels = list(trees)
                for k in range(args.rounds):
                    for label in labels[k % len(labels):] + labels[:k % len(labels)]:  # the order rotates
                        out = manager.dict()
                        mp.spawn(_rank, args=(trees[label], models[model], data, free_port(), args.timed, out),
                                 nprocs=WORLD)
                        row = rows.setdefault(f"{model} {label}", {"params": out["params"], "ms": []})
                        row.update({kind: list(v) for kind, v in out["counts"].items()})
                        row["ms"].append(out["ms"])
                first = rows[f"{model} {labels[0]}"]["ms"]
                for label in labels:
                    row = rows[f"{model} {label}"]
                    row["ratio"] = statistics.median(m / f for m, f in zip(row["ms"], first))
    finally:
        if args.before:  # the worktree goes, as rank_step.py's does
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before")], cwd=ROOT, check=False)
    print(f"ZeRO-3, {WORLD} ranks, {MICRO} micro-batches of 128 tokens a rank; rank 0's all-gathers in one iteration,"
          f" and the median iteration over {args.timed} (per round)")
    print(f"{'run':<22} {'params':>10} {'fwd gathers':>11} {'fwd MiB':>8} {'bwd gathers':>11} {'bwd MiB':>8}"
          f"  {'ms per round':<18} ratio")
    for name, row in rows.items():
        f, b = row.get("forward", (0, 0)), row.get("backward", (0, 0))
        ms = " ".join(f"{m:.0f}" for m in row["ms"])
        print(f"{name:<22} {row['params']:>10,} {f[0]:>11} {f[1] / 2**20:>8.2f} {b[0]:>11} {b[1] / 2**20:>8.2f}"
              f"  {ms:<18} {row['ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
