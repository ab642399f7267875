"""`train.compile` against eager, side by side in one invocation: step time, compile time and
peak memory at 2 ranks (gloo, one torch thread a rank), at the shapes of `step_time.py`'s grid:

    0.5M   GPT, 2 layers of width 128, micro-batch 2 x 64 tokens
    3M     GPT, 4 layers of width 256, micro-batch 8 x 128
    10M    the `small` preset (10.8M), micro-batch 16 x 256

each under `optim` (ZeRO-1) and `optim_grads_params` (ZeRO-3), gradient accumulation 1. The ranks
run as the actors run them (`Rank`: setup, then iterations); per point the eager run and the
compiled run follow each other in the same two processes, the compiled one with a cold inductor
cache (a directory of its own). Reported per point: the median step time over `--steps` steps
after the first (the slowest rank's), compiled / eager; the first step's compile seconds
(dynamo + AOT autograd + inductor, forward and backward: `phase_s["torch_compile"]`); the same
configuration again in a new group with the cache warm (what a restart or a spare pays); and
each run's peak RSS (VmHWM, reset before each run), compiled / eager.

Target (issue #50): compiled >= 1.2x faster than eager at the largest point, or the measured
reason why not on CPU.

    python benchmarks/compile.py [--steps 10] [--points 0.5M 3M 10M] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POINTS = {
    "0.5M": (["model.n_layer=2", "model.n_embd=128", "model.n_head=4"], 2, 64),
    "3M": (["model.n_layer=4", "model.n_embd=256", "model.n_head=4"], 8, 128),
    "10M": (["model.preset=small"], 16, 256),
}
STRATEGIES = ("optim", "optim_grads_params")


def _rank(rank: int, runs: list, data: str, steps: int, out) -> None:
    from peers import peak_mib, reset_peak  # this directory's: VmHWM, reset with the freed heap trimmed
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    for key, cfg, port, cache in runs:
        if cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        reset_peak()
        r = Rank(cfg, rank, 2, data)
        r.setup("127.0.0.1", port)
        times, compile_s = [], 0.0
        for k in range(steps + 1):
            t0 = time.perf_counter()
            res = r.iteration({"step": k, "lr": 1e-4})
            times.append(time.perf_counter() - t0)
            compile_s += res["phase_s"].get("torch_compile", 0.0)
        out[(key, rank)] = {"step_s": statistics.median(times[1:]), "first_s": times[0], "compile_s": compile_s,
                            "peak": peak_mib()[0]}
        r.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--points", nargs="*", default=list(POINTS))
    ap.add_argument("--data", default="", help="a prepared dataset (default: the stdlib's json sources, prepared)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from rayzero.config import load_config
    from rayzero.data.tokens import prepare
    from tests.conftest import free_port

    tmp = Path(tempfile.mkdtemp(prefix="compile-bench-"))
    data = args.data
    if not data:
        src = Path(json.__file__).parent
        data = str(tmp / "data")
        prepare(src, data, pattern="*.py")
    runs, keys = [], []
    for point in args.points:
        model, micro, seq = POINTS[point]
        for strategy in STRATEGIES:
            base = ["cluster.num_workers=2", *model, f"train.seq_len={seq}", f"train.micro_batch_size={micro}",
                    f"train.global_batch_size={2 * micro}", f"sharding.strategy={strategy}", "optim.warmup_steps=0"]
            cache = str(tmp / f"cache-{point}-{strategy}")
            for mode, extra, where in (("eager", [], ""), ("compiled", ["train.compile=true"], cache),
                                       ("compiled, cache warm", ["train.compile=true"], cache)):
                key = (point, strategy, mode)
                runs.append((key, load_config(None, [*base, *extra]), free_port(), where))
                keys.append(key)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(runs, data, args.steps, out), nprocs=2)
        out = dict(out)
    rows = {}
    for key in keys:
        ranks = [out[(key, r)] for r in range(2)]
        rows[key] = {"step_s": max(x["step_s"] for x in ranks), "compile_s": max(x["compile_s"] for x in ranks),
                     "first_s": max(x["first_s"] for x in ranks), "peak": max(x["peak"] for x in ranks)}
    print(f"{'point':6} {'strategy':19} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9} {'compile s':>10} "
          f"{'warm s':>7} {'peak MiB e/c':>14} {'ratio':>6}")
    result = []
    for point in args.points:
        for strategy in STRATEGIES:
            e, c, w = (rows[(point, strategy, m)] for m in ("eager", "compiled", "compiled, cache warm"))
            line = {"point": point, "strategy": strategy, "eager_ms": e["step_s"] * 1e3,
                    "compiled_ms": c["step_s"] * 1e3, "speedup": e["step_s"] / c["step_s"],
                    "compile_s": c["compile_s"], "warm_compile_s": w["compile_s"],
                    "peak_eager_mib": e["peak"], "peak_compiled_mib": c["peak"],
                    "peak_ratio": c["peak"] / e["peak"]}
            result.append(line)
            print(f"{point:6} {strategy:19} {line['eager_ms']:9.1f} {line['compiled_ms']:12.1f} "
                  f"{line['speedup']:8.2f}x {line['compile_s']:10.1f} {line['warm_compile_s']:7.1f} "
                  f"{line['peak_eager_mib']:6.0f}/{line['peak_compiled_mib']:<6.0f} {line['peak_ratio']:6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
