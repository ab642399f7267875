"""Every GPU check in one call: the CUDA test tier, ZeRO-3 against plain torch on one GPU, and
the CLI's tokens/s.

1. `pytest tests/gpu` (NCCL, every strategy in fp32 and bf16, device memory vs the ledger);
2. world size 1, NCCL, bf16: rayzero `optim_grads_params` against the same GPT trained by
   plain torch without sharding (bf16 autocast over fp32 parameters, fused AdamW), same
   batches, median step time over 30 steps after 10 warmup, in one process, alternating in
   5 rounds; target overhead <= 3 %; also device memory per parameter against the formula, and,
   from `torch.profiler` over 5 more steps of each (last round), the GPU's busy time a step
   against the step's wall time and the host's reads of device values a step: a step whose GPU
   is busy for much less than its wall time is bound by the host (launches and waits);
3. `train.compile` (inductor: Triton kernels) against eager, the same ZeRO-3 bf16 configuration,
   median step time after the warmup (the first step compiles), in 2 rounds alternating; target
   compiled >= 1.2x faster; also the compile seconds of the first step;
4. `rayzero train` on one GPU, for tokens/s and MFU as a user sees them.

    python benchmarks/gpu_checks.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.conftest, as the other benchmarks find it
CONFIG = ["cluster.num_workers=1", "cluster.use_gpu=true", "model.preset=medium", "train.seq_len=512",
          "train.global_batch_size=16", "train.micro_batch_size=8", "sharding.param_dtype=bf16",
          "sharding.strategy=optim_grads_params"]
STEPS, WARMUP, ROUNDS = 30, 10, 5


def time_rayzero(cfg, data_path: str, port: int) -> tuple[list[float], dict]:
    from rayzero.workers.rank import Rank

    rank = Rank(cfg, 0, 1, data_path)
    info = rank.setup("127.0.0.1", port)
    times, phases = [], []
    for k in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = rank.iteration({"step": k, "lr": 1e-4})
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        phases.append(out["phase_s"])
    info["device_bytes_per_param"] = torch.cuda.memory_allocated() / info["num_params"]
    # host seconds per phase (kernels are launched, not waited for): where a CPU-bound step goes
    info["phase_ms"] = {k: 1e3 * statistics.median(p.get(k, 0.0) for p in phases[WARMUP:]) for k in phases[-1]}
    info["busy"] = gpu_busy(lambda k: rank.iteration({"step": k, "lr": 1e-4}), STEPS)
    rank.close()
    return times, info


def gpu_busy(step, first: int, n: int = 5) -> dict:
    """`step(k)` for k = first .. first + n - 1 under torch.profiler: per step, the GPU's busy
    time (every kernel's own device time, summed) and the host's reads of a device value
    (`aten::_local_scalar_dense`: `.item()`, `float()`, `int()` of a GPU tensor)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(first, first + n):
            step(k)
        torch.cuda.synchronize()
    events = prof.key_averages()
    return {"gpu_busy_ms": sum(e.self_device_time_total for e in events) / n / 1e3,
            "device_reads": sum(e.count for e in events if e.key == "aten::_local_scalar_dense") / n}


def time_plain(cfg, data_path: str) -> tuple[list[float], list[float], dict]:
    from rayzero.data.batches import RankBatches
    from rayzero.data.tokens import TokenDataset
    from rayzero.models.gpt import build_model

    model = build_model(cfg.model, cfg.block_size, cfg.train.seed).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = RankBatches(TokenDataset(data_path), seed=cfg.train.seed, global_batch=cfg.train.global_batch_size,
                       micro_batch=cfg.train.micro_batch_size, seq_len=cfg.train.seq_len, dp_rank=0, dp_size=1)
    def step(k: int) -> None:
        for x, y in data.microbatches(k):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x.cuda(non_blocking=True))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.cuda().flatten(), reduction="sum")
            (loss / data.tokens_per_step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, host = [], []
    for k in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(k)
        host.append(time.perf_counter() - t0)  # launched, not yet done
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    busy = gpu_busy(step, STEPS)
    step = model = opt = None  # freed before rayzero's run: the closure held them
    torch.cuda.empty_cache()
    return times, host, busy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    import os

    from rayzero.config import load_config
    from rayzero.data.corpus import ensure_default_corpus
    from rayzero.jobs.train import resolve_data
    from rayzero.sharding.memory import formula_bytes_per_param
    from tests.conftest import free_port

    print(f"device: {torch.cuda.get_device_name()}")
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "gpu")], cwd=ROOT)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    data_path = ensure_default_corpus("~/.cache/rayzero/datasets")
    cfg = load_config(None, CONFIG + [f"data.path={data_path}"])
    resolve_data(cfg)
    ratios, info = [], {}
    for r in range(ROUNDS):
        plain_times, plain_host, plain_busy = time_plain(cfg, data_path)
        plain = statistics.median(plain_times[WARMUP:])
        times, info = time_rayzero(cfg, data_path, free_port())
        ours = statistics.median(times[WARMUP:])
        ratios.append(ours / plain)
        print(f"round {r + 1}: plain torch {plain * 1e3:.1f} ms, rayzero ZeRO-3 bf16 {ours * 1e3:.1f} ms, "
              f"ratio {ours / plain:.3f}; plain torch host ms "
              f"{statistics.median(plain_host[WARMUP:]) * 1e3:.1f}, rayzero host ms by phase: "
              + "  ".join(f"{k} {v:.1f}" for k, v in info["phase_ms"].items()))
    ratio = statistics.median(ratios)
    ours_busy = info["busy"]
    print(f"GPU busy a step (torch.profiler, 5 steps, last round): plain torch {plain_busy['gpu_busy_ms']:.1f} ms "
          f"of its {plain * 1e3:.1f} ms step ({plain_busy['device_reads']:g} device reads a step), rayzero ZeRO-3 "
          f"{ours_busy['gpu_busy_ms']:.1f} ms of its {ours * 1e3:.1f} ms ({ours_busy['device_reads']:g} device reads)")
    formula = formula_bytes_per_param("optim_grads_params", 1, param_bytes=2)
    print(f"ZeRO-3 / plain torch median step time: {ratio:.3f} (target <= 1.03)")
    print(f"device bytes per parameter: {info['device_bytes_per_param']:.2f} (formula {formula:.0f}, "
          f"ledger {info['memory']['total'] / info['num_params']:.2f})")

    compiled_cfg = load_config(None, CONFIG + [f"data.path={data_path}", "train.compile=true"])
    speedups = []
    for r in range(2):
        eager = statistics.median(time_rayzero(cfg, data_path, free_port())[0][WARMUP:])
        times, _ = time_rayzero(compiled_cfg, data_path, free_port())
        speedups.append(eager / statistics.median(times[WARMUP:]))
        print(f"round {r + 1}: eager {eager * 1e3:.1f} ms, compiled {statistics.median(times[WARMUP:]) * 1e3:.1f} ms, "
              f"speed-up {speedups[-1]:.2f}x")
    print(f"train.compile speed-up, median of rounds: {statistics.median(speedups):.2f}x (target >= 1.2)")

    rayzero = Path(sys.executable).with_name("rayzero")
    rc |= subprocess.call([str(rayzero), "train", "cluster.num_workers=1", "cluster.use_gpu=true",
                           "model.preset=small", "train.steps=50", "train.global_batch_size=32",
                           "train.micro_batch_size=8", "train.seq_len=256", "tracking.enabled=false",
                           "--no-progress"], cwd=ROOT)
    if args.json:
        Path(args.json).write_text(json.dumps({"ratio": ratio, "rounds": ratios, "device_bytes_per_param":
                                               info["device_bytes_per_param"], "formula": formula,
                                               "gpu_busy": {"plain": plain_busy, "rayzero": ours_busy},
                                               "compile_speedups": speedups}, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
