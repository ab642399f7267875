"""Every GPU check in one call: the CUDA test tier, ZeRO-3 against plain torch on one GPU, and
the CLI's tokens/s.

1. `pytest tests/gpu` (NCCL, every strategy in fp32 and bf16, device memory vs the ledger);
2. world size 1, NCCL, bf16: rayzero `optim_grads_params` against the same GPT trained by
   plain torch without sharding (bf16 autocast over fp32 parameters, fused AdamW), same
   batches, median step time over 30 steps after 10 warmup, in one process, alternating in
   5 rounds; target overhead <= 3 %; also device memory per parameter against the formula;
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
    rank.close()
    return times, info


def time_plain(cfg, data_path: str) -> tuple[list[float], list[float]]:
    from rayzero.data.batches import RankBatches
    from rayzero.data.tokens import TokenDataset
    from rayzero.models.gpt import build_model

    model = build_model(cfg.model, cfg.block_size, cfg.train.seed).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = RankBatches(TokenDataset(data_path), seed=cfg.train.seed, global_batch=cfg.train.global_batch_size,
                       micro_batch=cfg.train.micro_batch_size, seq_len=cfg.train.seq_len, dp_rank=0, dp_size=1)
    times, host = [], []
    for k in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, y in data.microbatches(k):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x.cuda(non_blocking=True))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.cuda().flatten(), reduction="sum")
            (loss / data.tokens_per_step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        host.append(time.perf_counter() - t0)  # launched, not yet done
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del model, opt
    torch.cuda.empty_cache()
    return times, host


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
        plain_times, plain_host = time_plain(cfg, data_path)
        plain = statistics.median(plain_times[WARMUP:])
        times, info = time_rayzero(cfg, data_path, free_port())
        ours = statistics.median(times[WARMUP:])
        ratios.append(ours / plain)
        print(f"round {r + 1}: plain torch {plain * 1e3:.1f} ms, rayzero ZeRO-3 bf16 {ours * 1e3:.1f} ms, "
              f"ratio {ours / plain:.3f}; plain torch host ms "
              f"{statistics.median(plain_host[WARMUP:]) * 1e3:.1f}, rayzero host ms by phase: "
              + "  ".join(f"{k} {v:.1f}" for k, v in info["phase_ms"].items()))
    ratio = statistics.median(ratios)
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
                                               "compile_speedups": speedups}, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
