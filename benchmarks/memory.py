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

With `--activations`: activation checkpointing `none`, `selective` and `full` side by side, in
alternating rounds, on an HF Llama of about 100M parameters (10 layers of width 768, MLP
2,048, a 32k vocabulary) at seq 1,024, 2 ranks, ZeRO-3, each mode in fresh rank processes:
per rank the peak RSS, the saved activations a micro-batch leaves (what the rank measures,
beside the dry-run's estimate) and the step time (median of the steps after the first).
Targets: `full` step time <= 1.35x `none` (about one extra forward), its activations <= 1/4
of `none`'s; `selective` in between.

    python benchmarks/memory.py --activations [--rounds 2] [--steps 4] [--json PATH]

With `--lora`: LoRA (r=16 on every linear layer of the blocks) against full fine-tuning of the
same ~100M HF Llama, bf16 parameters, 2 ranks ZeRO-3, in alternating rounds: the model state per
rank from the ledger against the formula (18/d bytes per trained parameter, 2/d per frozen one)
and the step time. Targets: LoRA's model state <= 0.30x full fine-tuning's; its step time below.

    python benchmarks/memory.py --lora [--rounds 2] [--steps 4] [--json PATH]

With `--dpo`: preference tuning (`train.objective=dpo`, sigmoid loss) on an HF Llama of about
15M parameters, full fine-tuning and LoRA, against the SFT step on the same rows (the language-
model loss on the same completion tokens), fp32 (CPU's bf16 matmuls are ten times slower), 2
ranks ZeRO-3, in alternating rounds: the model state per rank from the ledger, the reference's
included, against the formula (full DPO: 16/d per parameter + 4/d for the frozen reference;
LoRA-DPO: LoRA's, the reference being the base with its adapters off), and the step time over
its SFT step.

    python benchmarks/memory.py --dpo [--rounds 2] [--steps 4] [--json PATH]
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


MODES = ("none", "selective", "full")


def llama_100m(path: str) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _hf_rank(rank: int, model_dir: str, overrides: list[str], steps: int, data_path: str, port: int, out) -> None:
    """One of 2 ZeRO-3 ranks training the HF Llama in `model_dir` with `overrides`."""
    import resource
    import time

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "cluster.num_workers=2", "model.kind=hf", f"model.path={model_dir}", "train.seq_len=1024",
        "train.global_batch_size=2", "train.micro_batch_size=1", "sharding.strategy=optim_grads_params",
        f"data.path={data_path}", "optim.warmup_steps=0", *overrides,
    ])
    r = Rank(cfg, rank, 2, data_path)
    r.setup("127.0.0.1", port)
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        res = r.iteration({"step": k, "lr": lr_at(k, steps, cfg.optim)})
        times.append(time.perf_counter() - t0)
    out[rank] = {"step_s": sorted(times[1:])[len(times[1:]) // 2], "activations": res["memory"]["activations_peak"],
                 "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "loss": res["loss_sum"] / res["tokens"], "memory": res["memory"]}
    r.close()


def activations(rounds: int, steps: int, data_path: str) -> dict:
    import statistics
    import tempfile

    from rayzero.sharding.memory import activation_bytes
    from rayzero.workers.assembly import build_model, make_spec

    with tempfile.TemporaryDirectory() as tmp:
        n = llama_100m(tmp)
        cfg = load_config(None, ["model.kind=hf", f"model.path={tmp}", "train.seq_len=1024"])
        spec = make_spec(cfg)
        shape = spec.activation_shape(build_model(cfg, spec).model)
        estimate = {m: activation_bytes(shape, 1024, 1, 4, 0 if m == "none" else 1, m == "selective") for m in MODES}
        print(f"HF Llama, {n / 1e6:.0f}M parameters, seq 1,024, micro-batch 1, 2 ranks ZeRO-3, fp32; {rounds} round(s) "
              f"of {steps} steps\n")
        results: list[dict] = []
        for k in range(rounds):
            row = {}
            for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                with mp.Manager() as manager:
                    out = manager.dict()
                    mp.spawn(_hf_rank, args=(tmp, [f"model.activation_checkpointing={mode}"], steps, data_path,
                                             free_port(), out), nprocs=2)
                    ranks = [out[r] for r in range(2)]
                row[mode] = {"step_s": max(x["step_s"] for x in ranks),
                             "activations_mib": max(x["activations"] for x in ranks) / 2**20,
                             "peak_rss_mib": max(x["peak_rss"] for x in ranks) / 2**20, "loss": ranks[0]["loss"]}
                m = row[mode]
                print(f"round {k + 1}  {mode:<9}  step {m['step_s']:6.2f} s  activations {m['activations_mib']:7.1f} MiB "
                      f"(estimate {estimate[mode] / 2**20:7.1f})  peak RSS per rank {m['peak_rss_mib']:7.0f} MiB  "
                      f"loss {m['loss']:.4f}")
            results.append(row)
    ratio = {m: {key: statistics.median(r[m][key] / r["none"][key] for r in results)
                 for key in ("step_s", "activations_mib", "peak_rss_mib")} for m in MODES}
    print()
    for m in MODES[1:]:
        print(f"{m:<9} / none: step time {ratio[m]['step_s']:.3f}x, activations {ratio[m]['activations_mib']:.3f}x, "
              f"peak RSS {ratio[m]['peak_rss_mib']:.3f}x (median over rounds)")
    print("targets: full step time <= 1.35x, full activations <= 0.25x; selective in between")
    return {"benchmark": "memory-activations", "num_params": n, "rounds": results, "ratios": ratio,
            "estimate_mib": {m: v / 2**20 for m, v in estimate.items()}}


LORA = ["model.lora.r=16", "model.lora.alpha=32",
        "model.lora.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
STATE = ("compute_params", "main_params", "optimizer", "grads", "frozen_params")


def lora(rounds: int, steps: int, data_path: str) -> dict:
    """LoRA against full fine-tuning of the same model, bf16, 2 ranks ZeRO-3, in alternating rounds."""
    import statistics
    import tempfile

    from rayzero.workers.assembly import build_model, make_spec

    runs = {"full": ["sharding.param_dtype=bf16"], "lora": ["sharding.param_dtype=bf16", *LORA]}
    with tempfile.TemporaryDirectory() as tmp:
        n = llama_100m(tmp)
        cfg = load_config(None, ["model.kind=hf", f"model.path={tmp}", *LORA])
        spec = make_spec(cfg)
        total, trainable = spec.num_params(build_model(cfg, spec).model)
        # Megatron's ZeRO-3 with bf16 parameters: 18/d bytes per trained parameter; a frozen one
        # holds its bf16 copy alone, sharded: 2/d
        formula = {"full": 18 / 2 * n, "lora": 18 / 2 * trainable + 2 / 2 * (total - trainable)}
        print(f"HF Llama, {n / 1e6:.0f}M parameters; LoRA r=16 on every linear layer of the blocks: "
              f"{trainable:,} trained ({trainable / total:.2%}); seq 1,024, micro-batch 1, 2 ranks ZeRO-3, bf16; "
              f"{rounds} round(s) of {steps} steps\n")
        results: list[dict] = []
        for k in range(rounds):
            row = {}
            for name in (("full", "lora") if k % 2 == 0 else ("lora", "full")):
                with mp.Manager() as manager:
                    out = manager.dict()
                    mp.spawn(_hf_rank, args=(tmp, runs[name], steps, data_path, free_port(), out), nprocs=2)
                    ranks = [out[r] for r in range(2)]
                state = max(sum(x["memory"][key] for key in STATE) for x in ranks)
                row[name] = {"step_s": max(x["step_s"] for x in ranks), "state_mib": state / 2**20,
                             "formula_mib": formula[name] / 2**20,
                             "peak_rss_mib": max(x["peak_rss"] for x in ranks) / 2**20, "loss": ranks[0]["loss"],
                             "ledger": {key: ranks[0]["memory"][key] for key in STATE}}
                m = row[name]
                print(f"round {k + 1}  {name:<5}  step {m['step_s']:6.2f} s  model state per rank {m['state_mib']:7.1f} "
                      f"MiB (formula {m['formula_mib']:7.1f})  peak RSS per rank {m['peak_rss_mib']:7.0f} MiB  "
                      f"loss {m['loss']:.4f}")
            results.append(row)
    ratio = {key: statistics.median(r["lora"][key] / r["full"][key] for r in results)
             for key in ("step_s", "state_mib", "peak_rss_mib")}
    print(f"\nlora / full: model state {ratio['state_mib']:.3f}x, step time {ratio['step_s']:.3f}x, "
          f"peak RSS {ratio['peak_rss_mib']:.3f}x (median over rounds)")
    print("targets: model state <= 0.30x, step time below 1x")
    return {"benchmark": "memory-lora", "num_params": n, "trainable": trainable, "rounds": results, "ratios": ratio}


def _dpo_rank(rank: int, model_dir: str, overrides: list[str], steps: int, data_path: str, port: int, sft: bool,
              out) -> None:
    """One of 2 ZeRO-3 ranks: `train.objective=dpo` on the pairs at `data_path`, or (`sft`) the
    same rows with the language-model loss on their completion tokens (the preference step
    switched off after setup: the same tokens, the same model, no reference, no pair loss)."""
    import time

    torch.set_num_threads(1)
    cfg = load_config(None, [
        "cluster.num_workers=2", "model.kind=hf", f"model.path={model_dir}", "train.objective=dpo",
        "train.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=2",
        "sharding.strategy=optim_grads_params", f"data.path={data_path}", "optim.warmup_steps=0", *overrides])
    r = Rank(cfg, rank, 2, data_path)
    r.setup("127.0.0.1", port)
    if sft:  # next-token's loss on the same rows, in place of the pair loss
        from rayzero.objectives.next_token import NextToken

        r.steps.objective = NextToken(cfg).rank_side(r.steps.ctx)
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        res = r.iteration({"step": k, "lr": lr_at(k, steps, cfg.optim)})
        times.append(time.perf_counter() - t0)
    out[rank] = {"step_s": sorted(times[1:])[len(times[1:]) // 2], "memory": res["memory"],
                 "loss": res["loss_sum"] / max(res["tokens"], 1)}
    r.close()


def preference_data(root: str) -> tuple[str, str]:
    """An HF Llama of about 15M parameters, a BPE tokenizer trained on the stdlib's source and
    512 preference pairs cut from it, prepared with `--preferences`: (model dir, data path)."""
    import random
    import sys
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from rayzero.data.tokens import prepare

    text = Path(sys.modules["json"].__file__).parent.parent.joinpath("argparse.py").read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=4096, special_tokens=["<s>", "</s>"]))
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root + "/model")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(root + "/model")
    words, rng = text.split(), random.Random(0)
    with open(root + "/pairs.jsonl", "w") as f:
        for _ in range(512):
            a = rng.randrange(len(words) - 400)
            f.write(json.dumps({"prompt": " ".join(words[a: a + 40]), "chosen": " " + " ".join(words[a + 40: a + 120]),
                                "rejected": " " + " ".join(words[a + 200: a + 280])}) + "\n")
    prepare(root + "/pairs.jsonl", root + "/data", tokenizer=root + "/model", preferences=True)
    return root + "/model", root + "/data"


def dpo(rounds: int, steps: int) -> dict:
    """DPO against the same rows' SFT step, full fine-tuning and LoRA, fp32, 2 ranks ZeRO-3, in
    alternating rounds: the model state per rank (the reference's included) against the formula,
    and the step time."""
    import statistics
    import tempfile

    from rayzero.workers.assembly import build_model, make_spec

    runs = {"sft": ([], True), "dpo": ([], False), "lora-sft": (LORA, True), "lora-dpo": (LORA, False)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = preference_data(tmp)
        cfg = load_config(None, ["model.kind=hf", f"model.path={model_dir}", *LORA])
        spec = make_spec(cfg)
        total, trainable = spec.num_params(build_model(cfg, spec).model)
        n = total - trainable
        # ZeRO-3, fp32 parameters, d = 2: 16/d bytes per trained parameter, 4/d per frozen one;
        # DPO's reference is a frozen copy (4/d per parameter), LoRA's the base with adapters off (none)
        formula = {"sft": 16 / 2 * n, "dpo": 16 / 2 * n + 4 / 2 * n,
                   "lora-sft": 16 / 2 * trainable + 4 / 2 * n, "lora-dpo": 16 / 2 * trainable + 4 / 2 * n}
        print(f"HF Llama, {n / 1e6:.1f}M parameters (LoRA r=16 on every linear layer of the blocks: {trainable:,} "
              f"trained); 4 pairs (8 sequences) of seq 256 a step, micro-batch 2, 2 ranks ZeRO-3, fp32; {rounds} "
              f"round(s) of {steps} steps\n")
        results: list[dict] = []
        for k in range(rounds):
            row = {}
            for name in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
                extra, sft = runs[name]
                with mp.Manager() as manager:
                    out = manager.dict()
                    mp.spawn(_dpo_rank, args=(model_dir, extra, steps, data, free_port(), sft, out), nprocs=2)
                    ranks = [out[r] for r in range(2)]
                state = max(sum(x["memory"].get(key, 0) for key in (*STATE, "reference_params")) for x in ranks)
                row[name] = {"step_s": max(x["step_s"] for x in ranks), "state_mib": state / 2**20,
                             "formula_mib": formula[name] / 2**20, "loss": ranks[0]["loss"],
                             "reference_mib": max(x["memory"].get("reference_params", 0) for x in ranks) / 2**20}
                m = row[name]
                print(f"round {k + 1}  {name:<8}  step {m['step_s']:6.2f} s  model state per rank {m['state_mib']:7.2f} "
                      f"MiB (formula {m['formula_mib']:7.2f}; reference {m['reference_mib']:6.2f})  loss {m['loss']:.4f}")
            results.append(row)
    ratio = {name: {"state_over_formula": statistics.median(r[name]["state_mib"] / r[name]["formula_mib"]
                                                            for r in results)} for name in runs}
    for full, base in (("dpo", "sft"), ("lora-dpo", "lora-sft")):
        ratio[full]["step_over_sft"] = statistics.median(r[full]["step_s"] / r[base]["step_s"] for r in results)
    print()
    for name in runs:
        print(f"{name:<8} model state / formula {ratio[name]['state_over_formula']:.3f}x"
              + (f"; step time / its SFT step {ratio[name]['step_over_sft']:.3f}x" if "step_over_sft" in ratio[name]
                 else ""))
    print("expected: model state = formula (padding aside); a DPO step about 4/3 of its SFT step (the reference's "
          "forward beside the policy's forward and backward)")
    return {"benchmark": "memory-dpo", "num_params": n, "trainable_lora": trainable, "rounds": results,
            "ratios": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the table here as JSON")
    ap.add_argument("--preset", default="small", help="model.preset to measure (default small, 10.8M)")
    ap.add_argument("--activations", action="store_true", help="activation checkpointing none / selective / full")
    ap.add_argument("--lora", action="store_true", help="LoRA against full fine-tuning, bf16, ZeRO-3")
    ap.add_argument("--dpo", action="store_true", help="DPO (full and LoRA) against the SFT step, ZeRO-3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if args.dpo:
        result = dpo(args.rounds, args.steps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    if args.activations or args.lora:
        data_path = ensure_default_corpus("~/.cache/rayzero/datasets")
        result = (activations if args.activations else lora)(args.rounds, args.steps, data_path)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
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
