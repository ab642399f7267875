"""Expert parallelism against today's path: one small mixture of experts trained at ep 1 and at
ep = world, side by side, under ZeRO-3 (or `--strategy`).

The model: a Mixtral of 2 layers, 8 experts, top-2 (hidden 64, expert width 128), saved by
`save_pretrained`. For each world (default 2 and 4) and ep (1, world), `world` rank processes
(gloo, one torch thread each, the `Rank` a run's actors host) train a few steps and report:

- step time: the median over the steps after the first of the slowest rank's (at world 4 four
  ranks share this machine's two cores: the times say what it costs here);
- model state per rank: the strategy's ledger (parameters, gradients, optimizer state) against
  the formula: Megatron's bytes per parameter for the strategy, over d data-parallel ranks for
  the dense parameters and over the d/ep ranks holding the same experts for a rank's E/ep
  experts (under ZeRO-3 a rank's state is the same either way: ZeRO-3 already splits every
  parameter d ways; under ZeRO-1 the experts' parameters and gradients are 1/ep a rank);
- bytes moved per step by rank 0: the parameters ZeRO-3 gathers (the all-gathers' received
  bytes), and what the all-to-alls send in forward (the step's `alltoall_bytes`): per MoE layer
  and micro-batch, (the pairs it sends to other ranks + the results it returns to them) x
  hidden x 4 bytes; backward sends as much again, its gradients' way back (not counted);
- the local experts at ep = world both ways (`moe.grouped_mm`): the family's loop over them,
  and one grouped matmul per projection (torch's `grouped_mm`, which this torch has on CPU);
- the load: the busiest expert's (token, expert) pairs over the mean, the steps' largest
  (measured where the tokens are dispatched: ep > 1).

    python benchmarks/moe.py [--worlds 2 4] [--steps 4] [--strategy optim_grads_params] [--json PATH]
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
SHAPE = dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2)


def _rank(rank: int, world: int, port: int, data: str, model: str, ep: int, grouped: bool, steps: int, strategy: str,
          out) -> None:
    sys.path.insert(0, str(ROOT))
    from rayzero.config import load_config
    from rayzero.sharding import comm
    from rayzero.sharding.memory import CATEGORIES
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    gathered = [0]
    inner = comm.Axis.start_all_gather

    def counting(self, full, local):  # what a rank receives of the others' shards (gloo's exchange or NCCL's)
        gathered[0] += (full.numel() - local.numel()) * full.element_size()
        return inner(self, full, local)

    comm.Axis.start_all_gather = counting
    cfg = load_config(None, [f"cluster.num_workers={world}", "model.kind=hf", f"model.path={model}",
                             "train.seq_len=64", f"train.global_batch_size={2 * world}", "train.micro_batch_size=1",
                             f"parallel.ep={ep}", f"sharding.strategy={strategy}", "optim.warmup_steps=0",
                             f"moe.grouped_mm={str(grouped).lower()}"])
    r = Rank(cfg, rank, world, data)
    r.setup("127.0.0.1", port)
    times, moved, sent, load = [], 0, 0, None  # load: measured only where the tokens are dispatched
    for k in range(steps):
        g0 = gathered[0]
        t0 = time.perf_counter()
        res = r.iteration({"step": k, "lr": 1e-3})
        times.append(time.perf_counter() - t0)
        moved, sent = gathered[0] - g0, (res.get("experts") or {}).get("alltoall_bytes", 0)
        load = max(load or 0.0, (res.get("experts") or {}).get("expert_load_max_over_mean", 0.0)) or None
    mem = res["memory"]
    experts = {n for n, _ in r.model.named_parameters() if ".experts." in n}
    numel = {"dense": sum(p.numel() for n, p in r.model.named_parameters() if n not in experts),
             "experts": sum(p.numel() for n, p in r.model.named_parameters() if n in experts)}
    out[rank] = {"times": times, "gathered": moved, "sent": sent, "load": load, "numel": numel,
                 "state": sum(mem.get(k, 0) for k in CATEGORIES),
                 "d": r.mesh.size("grad_shard"), "d_e": r.mesh.size("expert_shard"), "strategy": strategy}
    r.close()


def dataset(tmp: Path) -> str:
    from rayzero.data.tokens import prepare

    texts = tmp / "texts"
    texts.mkdir()
    src = Path(json.__file__).parent.parent
    for f in sorted((src / "json").glob("*.py")) + sorted((src / "email").glob("*.py")):
        (texts / f.name).write_text(f.read_text())
    prepare(texts, str(tmp / "data"), pattern="*.py", row_group_tokens=1 << 14)
    return str(tmp / "data")


def formula_state(numel: dict, d: int, d_e: int, strategy: str) -> float:
    """The model state a rank holds by Megatron's formula (fp32 parameters, gradients, Adam's two
    moments): the dense parameters over their d data-parallel ranks, the rank's experts over d_e."""
    from rayzero.sharding.memory import formula_bytes_per_param

    return (formula_bytes_per_param(strategy, d) * numel["dense"]
            + formula_bytes_per_param(strategy, d_e) * numel["experts"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.conftest import free_port
    from tests.models import save_hf_model

    tmp = Path(tempfile.mkdtemp())
    data = dataset(tmp)
    model = str(save_hf_model("mixtral", tmp / "mixtral", **SHAPE))
    rows = []
    with mp.Manager() as manager:
        for world in args.worlds:
            for ep, grouped in ((1, False), (world, False), (world, True)):
                out = manager.dict()
                mp.spawn(_rank, args=(world, free_port(), data, model, ep, grouped, args.steps, args.strategy, out),
                         nprocs=world)
                got = dict(out)
                step = statistics.median(max(got[r]["times"][k] for r in got) for k in range(1, args.steps))
                g = got[0]
                rows.append({"world": world, "ep": ep, "experts": "grouped" if grouped else "loop", "step_s": step, "state": g["state"],
                             "formula": formula_state(g["numel"], g["d"], g["d_e"], args.strategy), "gathered": g["gathered"],
                             "sent": g["sent"], "load": g["load"]})
                r = rows[-1]
                print(f"world {world} ep {ep} ({r['experts']}): step {step:.3f} s, state {r['state'] / 2**20:.2f} MiB a rank "
                      f"(formula {r['formula'] / 2**20:.2f}), gathered {r['gathered'] / 2**20:.2f} MiB, "
                      f"all-to-all sent {r['sent'] / 2**20:.3f} MiB, load max/mean "
                      f"{r['load'] if r['load'] is None else round(r['load'], 2)}", flush=True)
    print(f"\n{'world':>5} {'ep':>3} {'experts':>8} {'step s':>7} {'vs ep1':>7} {'state MiB':>9} {'/formula':>8} "
          f"{'gathered MiB':>12} {'a2a MiB':>8} {'load':>5}")
    base = {r["world"]: r for r in rows if r["ep"] == 1}
    for r in rows:
        b = base[r["world"]]
        print(f"{r['world']:>5} {r['ep']:>3} {r['experts']:>8} {r['step_s']:>7.3f} {r['step_s'] / b['step_s']:>6.2f}x "
              f"{r['state'] / 2**20:>9.2f} {r['state'] / r['formula']:>8.3f} {r['gathered'] / 2**20:>12.2f} "
              f"{r['sent'] / 2**20:>8.3f} {'-' if r['load'] is None else format(r['load'], '.2f'):>5}")
    report = {"rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
