"""Context parallelism at growing sequence lengths: one GPT trained at cp 1, 2 and 4, side by side.

For each sequence length (default 1,024 to 8,192 tokens) and each cp (1, 2, 4: world = cp, one
row per step), `cp` rank processes (gloo, one torch thread each, the `Rank` a run's actors host)
train a few steps of the same GPT (2 layers of width 128, 4 heads) and report, per rank:

- activations: the bytes the micro-batch's forward left saved for backward (the rank's meter),
  the largest over the ranks, and against cp 1's at the same length;
- step time: the median of the steps after the first (on this 2-core machine cp 4 runs 4 ranks
  on 2 cores: its time says what it costs here, not what it would on 4 devices);
- bytes exchanged: what rank 0 sent to its cp group in one step (`context_parallel.traffic`),
  against the formula: per attention layer and row of n = S/cp local tokens, kv heads h_kv, head
  dim d, e bytes an element (float32 here) —
      ring      2·h_kv·n·d · (2·(cp−1)·e + 4·cp)   (key/value blocks round the ring in forward and
                                                    again in backward, the fp32 dK/dV cp times)
      ulysses   2·(cp−1)/cp · n·d·(2·h + 2·h_kv)·e  (q, k, v and the output, there and back)
- the longest sequence that fits a per-rank activation cap (`--cap-mib`): the longest measured
  length under it, and the length the largest measurement extrapolates to (activations grow
  linearly with a rank's tokens: attention keeps no scores).

    python benchmarks/long_context.py [--lengths 1024 2048 4096 8192] [--cps 1 2 4]
                                      [--modes ring] [--steps 3] [--cap-mib 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.n_layer=2", "model.n_embd=128", "model.n_head=4"]


def _rank(rank: int, world: int, port: int, data: str, length: int, mode: str, steps: int, out) -> None:
    sys.path.insert(0, str(ROOT))
    from rayzero.config import load_config
    from rayzero.sharding import context_parallel
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    cfg = load_config(None, [f"cluster.num_workers={world}", *MODEL, f"model.block_size={length}",
                             f"train.seq_len={length}", "train.global_batch_size=1", "train.micro_batch_size=1",
                             f"parallel.cp={world}", f"parallel.cp_mode={mode}", "optim.warmup_steps=0"])
    r = Rank(cfg, rank, world, data)
    r.setup("127.0.0.1", port)
    times, act, sent = [], 0, 0
    for k in range(steps):
        before = context_parallel.traffic.sent
        t0 = time.perf_counter()
        res = r.iteration({"step": k, "lr": 1e-3})
        times.append(time.perf_counter() - t0)
        act = max(act, res["memory"]["activations_peak"])
        sent = context_parallel.traffic.sent - before
    out[rank] = {"times": times, "activations": act, "sent": sent, "loss": res["loss_sum"] / max(res["tokens"], 1)}
    r.close()


def formula(mode: str, cp: int, length: int, layers: int = 2, heads: int = 4, dim: int = 32, e: int = 4) -> int:
    """Bytes a rank sends in one step of one row (see the module's docstring)."""
    if cp == 1:
        return 0
    n = length // cp
    if mode == "ring":
        return layers * 2 * heads * n * dim * (2 * (cp - 1) * e + 4 * cp)
    return layers * 2 * (cp - 1) * n * dim * (4 * heads) * e // cp


def dataset(tmp: Path) -> str:
    from rayzero.data.tokens import prepare

    texts = tmp / "texts"
    texts.mkdir()
    src = Path(json.__file__).parent.parent
    for pkg in ("json", "email", "asyncio"):
        for f in sorted((src / pkg).glob("*.py")):
            (texts / f"{pkg}_{f.name}").write_text(f.read_text())
    prepare(texts, str(tmp / "data"), pattern="*.py", row_group_tokens=1 << 14)
    return str(tmp / "data")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["ring"], choices=["ring", "ulysses"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cap-mib", type=float, default=64.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.conftest import free_port

    data = dataset(Path(tempfile.mkdtemp()))
    rows = []
    with mp.Manager() as manager:
        for mode in args.modes:
            for length in args.lengths:
                for cp in args.cps:
                    if cp == 1 and mode != args.modes[0]:
                        continue  # cp 1 is the same run whatever the mode
                    out = manager.dict()
                    mp.spawn(_rank, args=(cp, free_port(), data, length, mode, args.steps, out), nprocs=cp)
                    got = dict(out)
                    step = statistics.median(max(got[r]["times"][k] for r in got) for k in range(1, args.steps))
                    rows.append({"mode": mode if cp > 1 else "-", "cp": cp, "length": length, "step_s": step,
                                 "activations": max(got[r]["activations"] for r in got), "sent": got[0]["sent"],
                                 "formula": formula(mode, cp, length), "loss": got[0]["loss"]})
                    print(f"{rows[-1]['mode']:>8} cp {cp}  S {length:>6}: step {step:6.2f} s, activations "
                          f"{rows[-1]['activations'] / 2**20:7.1f} MiB a rank, sent {rows[-1]['sent'] / 2**20:7.2f} MiB "
                          f"(formula {rows[-1]['formula'] / 2**20:7.2f})", flush=True)
    cap = args.cap_mib * 2**20
    print(f"\n{'mode':>8} {'cp':>3} {'S':>6} {'step s':>7} {'vs cp1':>7} {'act MiB':>8} {'vs cp1':>7} "
          f"{'sent MiB':>9} {'sent/formula':>12}")
    base = {r["length"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        b = base.get(r["length"])
        ratio = f"{r['step_s'] / b['step_s']:.2f}x" if b else "-"
        act = f"{r['activations'] / b['activations']:.2f}x" if b else "-"
        sent = f"{r['sent'] / r['formula']:.3f}" if r["formula"] else "-"
        print(f"{r['mode']:>8} {r['cp']:>3} {r['length']:>6} {r['step_s']:>7.2f} {ratio:>7} "
              f"{r['activations'] / 2**20:>8.1f} {act:>7} {r['sent'] / 2**20:>9.2f} {sent:>12}")
    fits = {}
    for (mode, cp) in sorted({(r["mode"], r["cp"]) for r in rows}, key=lambda k: k[1]):
        mine = sorted((r for r in rows if (r["mode"], r["cp"]) == (mode, cp)), key=lambda r: r["length"])
        under = [r["length"] for r in mine if r["activations"] <= cap]
        per_token = mine[-1]["activations"] / mine[-1]["length"]
        fits[f"{mode} cp {cp}"] = {"measured": max(under) if under else 0,
                                   "extrapolated": int(cap / per_token) // (2 * cp) * (2 * cp)}
        print(f"fits {args.cap_mib:g} MiB of activations a rank, {mode} cp {cp}: measured up to "
              f"{fits[f'{mode} cp {cp}']['measured']:,} tokens, extrapolated {fits[f'{mode} cp {cp}']['extrapolated']:,}")
    report = {"rows": rows, "fits": fits, "cap_mib": args.cap_mib}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
