"""Loading a pretrained HF model: rayzero ZeRO-3 against every rank calling `from_pretrained`.

The model is a Llama of a few hundred million parameters (by default 254M: 16 decoder layers
of width 1024, GQA with 8 key/value heads, MLP 2816, a 32k vocabulary, untied head; with
`--moe`, a Mixtral of the same width with 8 experts of 1408 a layer, whose checkpoint keeps one
tensor per expert where the model has one fused parameter per layer), saved
here with `save_pretrained` in bf16 across several safetensors files with an index, as models
come from the hub. At 4 ranks (gloo, one process each, started together), side by side in one
invocation, in rounds:

  baseline  what users do today: every rank calls `AutoModelForCausalLM.from_pretrained`
            (fp32), then `fully_shard` per decoder layer and on the root (FSDP2), AdamW, and
            runs its first step;
  rayzero   `Rank` with `sharding.strategy=optim_grads_params`: the model built on meta, each
            rank reading only the bytes of its shard, unit by unit, then its first step.

Reported per run: the wall time from the start of loading (after imports, process group up)
to the end of the first step, the slowest rank; each rank's peak RSS (ru_maxrss) while loading
(until the model and optimizer are ready to step) and through the first step, each also above
what the rank held before loading began (the loading's own cost: imports are the same for
both); and what each rank read from storage. The target: rayzero's loading peak above the
start <= its model state per rank (16 bytes/parameter / d) + one unit (the largest, fp32) + a
fixed margin (read buffers, allocator slack: reported, not assumed); and a time to the first
step below the baseline's.

    python benchmarks/loading.py [--rounds 2] [--layers 16] [--moe] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

WORLD = 4
MiB = 2**20


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(path: Path, layers: int, moe: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    shape = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                 num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False)
    if moe:  # 8 experts of 1408 per layer, stored one tensor per expert and fused in the model
        config = MixtralConfig(**shape, intermediate_size=1408, num_local_experts=8, num_experts_per_tok=2)
    else:
        config = LlamaConfig(**shape, intermediate_size=2816)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path), max_shard_size="200MB")
    # The largest unit: a decoder layer, or the embedding / the head (units of their own).
    layer = max(sum(p.numel() for p in m.parameters())
                for m in (model.model.layers[0], model.get_input_embeddings(), model.get_output_embeddings()))
    n = sum(p.numel() for p in model.parameters())
    del model
    return {"num_params": n, "unit_params": layer,
            "files": sorted(p.name for p in path.glob("*.safetensors")),
            "bytes": sum(p.stat().st_size for p in path.glob("*.safetensors"))}


def overrides(model_dir: str, data_path: str) -> list[str]:
    return [f"cluster.num_workers={WORLD}", "model.kind=hf", f"model.path={model_dir}", f"data.path={data_path}",
            "train.seq_len=64", f"train.global_batch_size={WORLD}", "train.micro_batch_size=1",
            "sharding.strategy=optim_grads_params", "optim.warmup_steps=0"]


def _rank(rank: int, kind: str, model_dir: str, data_path: str, port: int, out) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import transformers  # noqa: F401  imported before the clock and the baseline RSS, for both

    from rayzero.config import load_config
    from rayzero.workers.rank import Rank

    cfg = load_config(None, overrides(model_dir, data_path))
    if kind == "rayzero":
        r = Rank(cfg, rank, WORLD, data_path)
        start_rss, t0 = vm_rss(), time.perf_counter()
        info = r.setup("127.0.0.1", port)
        loaded = peak_rss()
        res = r.iteration({"step": 0, "lr": 1e-4})
        wall = time.perf_counter() - t0
        read, loss = info["source_bytes_read"], res["loss_sum"] / res["tokens"]
        r.close()
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        start_rss, t0 = vm_rss(), time.perf_counter()
        loss, read, loaded = baseline_first_step(cfg, model_dir, data_path, rank)
        wall = time.perf_counter() - t0
        dist.barrier()
        dist.destroy_process_group()
    out[rank] = {"wall_s": wall, "start_rss": start_rss, "loaded_rss": loaded, "peak_rss": peak_rss(),
                 "read": read, "loss": loss}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def baseline_first_step(cfg, model_dir: str, data_path: str, rank: int) -> tuple[float, int]:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from rayzero.data.batches import RankBatches
    from rayzero.data.tokens import TokenDataset

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loaded = peak_rss()
    data = RankBatches(TokenDataset(data_path), seed=cfg.train.seed, global_batch=WORLD, micro_batch=1,
                       seq_len=cfg.train.seq_len, dp_rank=rank, dp_size=WORLD)
    (batch,) = data.microbatches(0)
    x, y = batch.tokens, batch.targets
    loss = F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    read = sum((Path(model_dir) / f).stat().st_size for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    return float(loss.detach()), read, loaded


def run(kind: str, model_dir: str, data_path: str) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(kind, model_dir, data_path, free_port(), out), nprocs=WORLD)
        ranks = [out[r] for r in range(WORLD)]
    return {"wall_s": max(r["wall_s"] for r in ranks), "peak_rss_mib": [r["peak_rss"] / MiB for r in ranks],
            "above_start_mib": [(r["peak_rss"] - r["start_rss"]) / MiB for r in ranks],
            "loading_above_start_mib": [(r["loaded_rss"] - r["start_rss"]) / MiB for r in ranks],
            "read_mib": [r["read"] / MiB for r in ranks], "loss": ranks[0]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16: 254M parameters)")
    ap.add_argument("--moe", action="store_true", help="a Mixtral (8 experts a layer, saved one tensor per expert, "
                    "fused in the model) instead of the Llama")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    from rayzero.data.corpus import ensure_default_corpus

    data_path = ensure_default_corpus("~/.cache/rayzero/datasets")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / ("mixtral" if args.moe else "llama")
        model = make_model(model_dir, args.layers, args.moe)
        n, unit = model["num_params"], model["unit_params"]
        print(f"model: {n / 1e6:.0f}M parameters, {len(model['files'])} safetensors files of "
              f"{model['bytes'] / MiB:.0f} MiB (bf16); the largest unit {unit / 1e6:.1f}M; {WORLD} ranks, "
              f"{args.rounds} round(s)\n")
        rounds = []
        for k in range(args.rounds):
            order = ("baseline", "rayzero") if k % 2 == 0 else ("rayzero", "baseline")
            results = {kind: run(kind, str(model_dir), data_path) for kind in order}
            rounds.append(results)
            for kind in ("baseline", "rayzero"):
                r = results[kind]
                print(f"round {k + 1}  {kind:<9} first step after {r['wall_s']:6.1f} s; peak RSS per rank "
                      + " ".join(f"{m:6.0f}" for m in r["peak_rss_mib"]) + " MiB; above the start: loading "
                      + " ".join(f"{m:5.0f}" for m in r["loading_above_start_mib"]) + ", with the first step "
                      + " ".join(f"{m:5.0f}" for m in r["above_start_mib"]) + " MiB; read "
                      + " ".join(f"{m:5.0f}" for m in r["read_mib"]) + f" MiB; loss {r['loss']:.4f}")
    state = 16 * n / WORLD / MiB  # fp32 params, grads, two Adam moments, sharded over d
    unit_mib = 4 * unit / MiB
    time_ratio = statistics.median(r["rayzero"]["wall_s"] / r["baseline"]["wall_s"] for r in rounds)
    kinds = ("baseline", "rayzero")
    loading = {k: max(max(r[k]["loading_above_start_mib"]) for r in rounds) for k in kinds}
    peak = {k: max(max(r[k]["above_start_mib"]) for r in rounds) for k in kinds}
    rss_ratio = statistics.median(max(r["rayzero"]["peak_rss_mib"]) / max(r["baseline"]["peak_rss_mib"]) for r in rounds)
    margin = loading["rayzero"] - state - unit_mib
    print(f"\nrayzero / baseline time to the first step: {time_ratio:.3f}x (median over rounds; target < 1)")
    print(f"loading, peak above the start per rank: rayzero {loading['rayzero']:.0f} MiB = model state / d "
          f"{state:.0f} MiB + one unit {unit_mib:.0f} MiB + {margin:.0f} MiB (read buffers, allocator); baseline "
          f"{loading['baseline']:.0f} MiB: {loading['rayzero'] / loading['baseline']:.3f}x (the whole model in fp32 "
          f"is {4 * n / MiB:.0f} MiB)")
    print(f"through the first step, peak above the start per rank: rayzero {peak['rayzero']:.0f} MiB, baseline "
          f"{peak['baseline']:.0f} MiB; peak RSS per rank rayzero / baseline {rss_ratio:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "loading", "model": model, "world_size": WORLD, "rounds": rounds,
            "time_ratio": time_ratio, "peak_rss_ratio": rss_ratio, "peak_above_start_mib": peak,
            "loading_above_start_mib": loading,
            "state_per_rank_mib": state, "unit_mib": unit_mib, "margin_mib": margin}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
