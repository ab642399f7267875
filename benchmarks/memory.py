"""Bytes per parameter each strategy holds, measured, beside Megatron's formula.

For every strategy, with fp32 and with bf16 compute parameters (fp32 gradients), at d = 2 and
4 data-parallel ranks (gloo, plain processes): each rank builds the model, trains two steps,
and reports
  - ledger: the model state its strategy accounts for (compute and main parameters,
    gradients, optimizer state), bytes per model parameter, max over ranks;
  - measured: every tensor storage alive in the rank process beyond what was alive before the
    rank was built (a gc walk, independent of the ledger), bytes per parameter, max over ranks;
  - formula: Megatron's table (fp32: 16, 8 + 8/d, 4 + 12/d, 16/d; bf16: 18, 6 + 12/d,
    2 + 16/d, 18/d), and measured / formula;
  - the peak transient (gathered units, full gradient buckets) in MiB and, for ZeRO-3, in
    units of "two units' full parameters and gradients", which it must not exceed.
Padding makes the measured figure slightly larger than the formula (buckets pad to a
multiple of d x 64 elements).

    python benchmarks/memory.py [--json PATH] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import socket

import torch
import torch.multiprocessing as mp

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.data.corpus import ensure_default_corpus
from rayzero.jobs.train import resolve_data
from rayzero.sharding.config import STRATEGIES
from rayzero.sharding.memory import formula_bytes_per_param, live_tensor_bytes
from rayzero.workers.rank import Rank

DTYPES = {"fp32": 4, "bf16": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, preset: str, data_path: str, ports: list[int], out) -> None:
    torch.set_num_threads(1)
    runs = [(s, d) for s in STRATEGIES for d in DTYPES]
    for (strategy, dtype), port in zip(runs, ports):
        cfg = load_config(None, [
            f"cluster.num_workers={world}", f"model.preset={preset}", "train.seq_len=64",
            f"train.global_batch_size={2 * world}", "train.micro_batch_size=1",
            f"sharding.strategy={strategy}", f"sharding.param_dtype={dtype}", f"data.path={data_path}",
        ])
        baseline = live_tensor_bytes()
        r = Rank(cfg, rank, world, data_path)
        info = r.setup("127.0.0.1", port)
        for k in range(2):
            res = r.iteration({"step": k, "lr": lr_at(k, 2, cfg.optim)})
        r.strategy.finish_param_sync()
        biggest = max(b.world.size for b in r.strategy.buffer.buckets)
        out[(strategy, dtype, rank)] = {
            "num_params": info["num_params"], "ledger": res["memory"],
            "live": live_tensor_bytes() - baseline, "biggest_bucket": biggest,
        }
        r.close()
        del r


def measure(world: int, preset: str, data_path: str) -> list[dict]:
    with mp.Manager() as manager:
        out = manager.dict()
        ports = [free_port() for _ in range(len(STRATEGIES) * len(DTYPES))]
        mp.spawn(_rank, args=(world, preset, data_path, ports, out), nprocs=world)
        out = dict(out)
    rows = []
    for strategy in STRATEGIES:
        for dtype, pbytes in DTYPES.items():
            ranks = [out[(strategy, dtype, r)] for r in range(world)]
            n = ranks[0]["num_params"]
            formula = formula_bytes_per_param(strategy, world, param_bytes=pbytes)
            ledger = max(r["ledger"]["total"] for r in ranks) / n
            live = max(r["live"] for r in ranks) / n
            transient = max(r["ledger"]["transient_peak"] for r in ranks)
            two_units = 2 * ranks[0]["biggest_bucket"] * (pbytes + 4)
            rows.append({
                "strategy": strategy, "param_dtype": dtype, "d": world, "num_params": n,
                "formula": formula, "ledger": ledger, "measured": live, "measured_over_formula": live / formula,
                "categories": {k: max(r["ledger"][k] for r in ranks) / n
                               for k in ("compute_params", "main_params", "grads", "optimizer")},
                "transient_mib": transient / 2**20,
                "transient_over_two_units": transient / two_units if strategy == "optim_grads_params" else None,
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the table here as JSON")
    ap.add_argument("--preset", default="small", help="model.preset to measure (default small, 10.8M)")
    args = ap.parse_args()
    data_path = ensure_default_corpus("~/.cache/rayzero/datasets")
    resolve_data(load_config(None, [f"data.path={data_path}"]))
    rows = [row for d in (2, 4) for row in measure(d, args.preset, data_path)]
    print(f"model.preset={args.preset}: {rows[0]['num_params']:,} parameters; bytes per parameter, max over ranks\n")
    print(f"{'strategy':<20} {'params':>6} {'d':>2}  {'formula':>7}  {'ledger':>7}  {'measured':>8}  "
          f"{'meas/formula':>12}  {'transient MiB':>13}  {'of 2 units':>10}")
    for r in rows:
        units = f"{r['transient_over_two_units']:>10.2f}" if r["transient_over_two_units"] is not None else f"{'-':>10}"
        print(f"{r['strategy']:<20} {r['param_dtype']:>6} {r['d']:>2}  {r['formula']:>7.2f}  {r['ledger']:>7.2f}  "
              f"{r['measured']:>8.2f}  {r['measured_over_formula']:>12.3f}  {r['transient_mib']:>13.1f}  {units}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "memory", "preset": args.preset, "rows": rows}, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
