"""Tensor parallelism: bytes communicated per step per rank on each axis, counted at the
collectives, and memory per rank, against the formulas, at tp 1, 2 and 4, with the
vocabulary (32k) split over the TP ranks (the default) and replicated (`2r`, `4r`).

An HF Llama of about 100M parameters (10 layers of width 768, 12 heads and 4 key/value heads,
MLP 2,048, a 32k vocabulary, from its config, random init) at world 4 as tp 1 x dp 4,
tp 2 x dp 2 and tp 4 x dp 1, ZeRO-1, fp32, seq 256, micro-batch 1, one micro-batch per
data-parallel rank per step (gloo, plain processes). Every collective a rank calls during its
second step is counted by the axis of its group, as the bytes of the tensor it is given (an
all-gather: the gathered tensor; gloo's reduce-scatter is an in-place all-reduce of the bucket),
beside:

  - TP: 4 all-reduces of b·s·h elements per layer and micro-batch (Megatron's f and g: 2 in
    forward after the attention and MLP outputs, 2 in backward at their inputs), times 4 bytes;
    with sequence parallelism (`2sp`, `4sp`) 8 all-gathers and reduce-scatters of b·s·h per
    layer (gloo has no reduce-scatter: an all-reduce of b·s·h), plus the final norm's gather
    and the first block's input gradient's; with the vocabulary split, 2 more of b·s·h (the
    embedding's partial lookups summed, the head's "f" in backward) and the loss's 3·b·s floats
    (the row maximum; the sum of exponentials and the target's logit);
  - DP, ZeRO-1 on gloo: the gradient buckets all-reduced and the parameters all-gathered, 2 x
    this rank's parameters (its TP share, padded) x 4 bytes (plus the step's scalar all-reduces);
  - model state per rank: Megatron's formula (ZeRO-1: 4 + 4 + 8/d bytes per parameter) x this
    rank's parameters (the split ones / tp, the vocabulary's rows ceil(V / tp) when split, the
    replicated whole), against the ledger;
  - activations per micro-batch: the dry run's estimate (Korthikanti's count with tp) against
    what the rank measures its forward leaves saved for backward.

On a CPU the step time of TP says nothing about a GPU: bytes and memory only.

    python benchmarks/tp.py [--tp 1,2,4,2sp,4sp,2r,4r] [--seq 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_100m(path: str) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


class Counter:
    """Bytes given to each collective, by the axis of its group, while `on`."""

    def __init__(self, mesh):
        self.names = {}
        for name in ("world", "grad_reduce", "grad_shard", "grad_replicate", "tp"):  # later names win for shared groups
            axis = mesh.axis(name)
            if axis is not None and axis.size > 1:
                self.names[id(axis.group)] = "tp" if name == "tp" else "dp" if name != "world" else "world"
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def count(self, group, t: torch.Tensor, what: str) -> None:
        if self.on:
            axis = self.names.get(id(group if group is not None else dist.group.WORLD), "world")
            self.bytes[axis] += t.numel() * t.element_size()
            self.calls[f"{axis} {what}"] += 1

    def install(self) -> None:
        import rayzero.sharding.comm as comm

        all_reduce, all_gather, all_gather_list = dist.all_reduce, comm._all_gather, dist.all_gather

        def counted_all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.count(group, t, "all-reduce")
            return all_reduce(t, op=op, group=group, async_op=async_op)

        def counted_all_gather(out, local, group=None, async_op=False):
            self.count(group, out, "all-gather")
            return all_gather(out, local, group=group, async_op=async_op)

        def counted_all_gather_list(outs, local, group=None, async_op=False):
            self.count(group, torch.cat([o.reshape(-1) for o in outs]), "all-gather")
            return all_gather_list(outs, local, group=group, async_op=async_op)

        dist.all_reduce = counted_all_reduce
        comm._all_gather = counted_all_gather
        dist.all_gather = counted_all_gather_list


def _rank(rank: int, tp: int, sp: bool, vocab: bool, model_dir: str, data_path: str, seq: int, port: int,
          out) -> None:
    from rayzero.cluster.schedule import lr_at
    from rayzero.config import load_config
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    dp = WORLD // tp
    cfg = load_config(None, [
        f"cluster.num_workers={WORLD}", f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}",
        f"parallel.vocab_parallel={str(vocab).lower()}", "model.kind=hf", f"model.path={model_dir}",
        f"train.seq_len={seq}", f"train.global_batch_size={dp}", "train.micro_batch_size=1",
        "sharding.strategy=optim", f"data.path={data_path}", "optim.warmup_steps=0",
    ])
    r = Rank(cfg, rank, WORLD, data_path)
    info = r.setup("127.0.0.1", port)
    counter = Counter(r.mesh)
    counter.install()
    r.iteration({"step": 0, "lr": lr_at(0, 2, cfg.optim)})
    counter.on = True
    res = r.iteration({"step": 1, "lr": lr_at(1, 2, cfg.optim)})
    counter.on = False
    out[rank] = {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "memory": res["memory"],
                 "params_per_rank": info["params_per_rank"], "num_params": info["num_params"],
                 "padded": info["buffer_numel"], "loss": res["loss_sum"] / max(res["tokens"], 1)}
    r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2,4,2sp,4sp,2r,4r",
                    help="TP sizes; `sp`: with sequence parallelism; `r`: the vocabulary replicated, not split")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    from rayzero.config import load_config
    from rayzero.jobs.train import resolve_data
    from rayzero.sharding.memory import activation_bytes, formula_bytes_per_param
    from rayzero.workers.assembly import build_model, make_spec

    data_path = resolve_data(load_config(None, []))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        n = llama_100m(tmp)
        cfg = load_config(None, ["model.kind=hf", f"model.path={tmp}"])
        spec = make_spec(cfg)
        shape = spec.activation_shape(build_model(cfg, spec).model)
        b, s, h, layers = 1, args.seq, shape.hidden, shape.layers
        print(f"HF Llama, {n / 1e6:.1f}M parameters ({layers} layers, h {h}, 12 heads, 4 key/value heads), "
              f"world {WORLD}, ZeRO-1, fp32, seq {s}, micro-batch {b}, one micro-batch per data-parallel rank\n")
        for size in args.tp.split(","):
            sp, vocab = size.endswith("sp"), not size.endswith("r")
            tp = int(size.removesuffix("sp").removesuffix("r"))
            dp = WORLD // tp
            with mp.Manager() as manager:
                out = manager.dict()
                mp.spawn(_rank, args=(tp, sp, vocab, tmp, data_path, s, free_port(), out), nprocs=WORLD)
                ranks = [out[r] for r in range(WORLD)]
            r0 = ranks[0]
            micro = 1
            split = vocab and tp > 1
            # an all-reduce, or with SP an all-gather or (gloo: all-reduce for) reduce-scatter, of b·s·h
            # each: 4 per block, or 8 with SP plus the final norm's gather and the first block's
            # input gradient's; the vocabulary split: the embedding's sum and the head's "f", and the
            # loss's 3 floats per token
            per_step = ((8 * layers + 2) if sp else 4 * layers) + (2 if split else 0)
            tp_formula = (per_step * b * s * h + (3 * b * s if split else 0)) * 4 * micro if tp > 1 else 0
            dp_formula = 2 * r0["padded"] * 4 if dp > 1 else 0
            state = max(sum(x["memory"][k] for k in ("compute_params", "main_params", "optimizer", "grads"))
                        for x in ranks)
            state_formula = formula_bytes_per_param("optim", dp) * r0["params_per_rank"]
            act = max(x["memory"]["activations_peak"] for x in ranks)
            act_formula = activation_bytes(shape, s, b, 4, tp=tp, sequence_parallel=sp, vocab_parallel=split)
            row = {"tp": tp, "sequence_parallel": sp, "vocab_parallel": split, "dp": dp,
                   "params_per_rank": r0["params_per_rank"],
                   "tp_bytes": max(x["bytes"].get("tp", 0) for x in ranks), "tp_formula": tp_formula,
                   "dp_bytes": max(x["bytes"].get("dp", 0) for x in ranks), "dp_formula": dp_formula,
                   "calls": r0["calls"], "state_bytes": state, "state_formula": state_formula,
                   "activations_bytes": act, "activations_estimate": act_formula, "loss": r0["loss"]}
            rows.append(row)
            mib = 2**20
            how = [w for w, on in (("sequence parallelism", sp), ("the vocabulary split", split),
                                   ("the vocabulary replicated", tp > 1 and not vocab)) if on]
            print(f"tp {tp} x dp {dp}{' with ' + ' and '.join(how) if how else ''}: "
                  f"{row['params_per_rank']:,} parameters per rank")
            print(f"  TP axis  {row['tp_bytes'] / mib:9.2f} MiB per step per rank   formula {tp_formula / mib:9.2f} MiB"
                  + (f"   ratio {row['tp_bytes'] / tp_formula:.3f}" if tp_formula else ""))
            print(f"  DP axis  {row['dp_bytes'] / mib:9.2f} MiB per step per rank   formula {dp_formula / mib:9.2f} MiB"
                  + (f"   ratio {row['dp_bytes'] / dp_formula:.3f}" if dp_formula else ""))
            print(f"  model state {state / mib:8.1f} MiB per rank   formula {state_formula / mib:8.1f} MiB   "
                  f"ratio {state / state_formula:.3f}")
            print(f"  activations {act / mib:8.1f} MiB a micro-batch   estimate {act_formula / mib:8.1f} MiB   "
                  f"ratio {act / act_formula:.3f}")
            print(f"  collectives: {', '.join(f'{k} x{v}' for k, v in sorted(r0['calls'].items()))}\n")
    _vocab_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "tp", "num_params": n, "seq": args.seq, "rows": rows}, f, indent=2)


def _vocab_table(rows: list[dict]) -> None:
    """Memory per rank with the 32k vocabulary split against replicated, at each TP size run both ways."""
    mib = 2**20
    split = {r["tp"]: r for r in rows if not r["sequence_parallel"] and r["vocab_parallel"]}
    replicated = {r["tp"]: r for r in rows if not r["sequence_parallel"] and not r["vocab_parallel"] and r["tp"] > 1}
    pairs = [(t, split[t], replicated[t]) for t in sorted(split) if t in replicated]
    if not pairs:
        return
    print("the 32k vocabulary split against replicated (memory per rank, measured; the formula's ratio beside):")
    for t, v, r in pairs:  # v: the vocabulary split, r: replicated
        print(f"  tp {t}: model state {v['state_bytes'] / mib:.1f} vs {r['state_bytes'] / mib:.1f} MiB "
              f"({v['state_bytes'] / r['state_bytes']:.3f}x; formula {v['state_formula'] / r['state_formula']:.3f}x), "
              f"activations {v['activations_bytes'] / mib:.1f} vs {r['activations_bytes'] / mib:.1f} MiB "
              f"({v['activations_bytes'] / r['activations_bytes']:.3f}x; "
              f"estimate {v['activations_estimate'] / r['activations_estimate']:.3f}x)")


if __name__ == "__main__":
    main()
