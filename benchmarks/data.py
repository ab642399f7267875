"""Tokenization throughput of `rayzero data prepare` against `datasets.Dataset.map`, and the
training step's data time.

The text: the Python standard library's source (one document per file), the tokenizer: a
byte-level BPE of 8,192 ids trained here with `tokenizers` on part of it, loaded as a fast
tokenizer. Each run goes from the files on disk to token ids on disk:

    rayzero              `prepare(..., tokenizer=DIR)`: one process (the Rust tokenizer's
                         own threads), Parquet shards
    rayzero --ray        the same through Ray Data on a local Ray with 2 tokenizing workers
    datasets.map         the baseline: files read into `Dataset.from_dict`, `map(batched=True,
                         num_proc=2)` with the same fast tokenizer (ids + EOS), `save_to_disk`

in rounds, the order rotating; the figure is the median MB of text per second and its ratio
to the baseline's (target: >= 1). Then a short training run (2 ranks, HF Llama of a few M
parameters, the prepared data) reports the data time (the ranks' reading of their rows of
the step, `data_ms`) as a share of the step (target: < 2%).

    python benchmarks/data.py [--rounds 3] [--max-mb 20]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BASELINE = "datasets.map"
RUNS = ("rayzero", "rayzero --ray", BASELINE)


def corpus(out: Path, max_mb: float) -> tuple[Path, int]:
    """Standard-library .py files (UTF-8 ones), copied flat into `out`, up to `max_mb`."""
    from rayzero.data.corpus import stdlib_dir

    out.mkdir(parents=True)
    total = count = 0
    for f in sorted(stdlib_dir().rglob("*.py")):
        if "site-packages" in f.parts or "dist-packages" in f.parts:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (out / f"{count:06d}.py").write_text(text, encoding="utf-8")
        total += len(text.encode())
        count += 1
        if total >= max_mb * 2**20:
            break
    return out, total


def train_tokenizer(texts_dir: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = [f.read_text() for f in sorted(texts_dir.iterdir())[:300]]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(out))
    return out


def run_rayzero(texts: Path, tok: Path, out: Path, use_ray: bool) -> float:
    from rayzero.data.tokens import prepare
    from rayzero.jobs.ray_prepare import prepare_on_ray

    t0 = time.perf_counter()
    if use_ray:
        prepare_on_ray(texts, str(out), workers=2, tokenizer=str(tok))
    else:
        prepare(texts, str(out), tokenizer=str(tok))
    return time.perf_counter() - t0


def run_datasets(texts: Path, tok: Path, out: Path) -> float:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(tok))
    eos = tokenizer.eos_token_id
    ds = datasets.Dataset.from_dict({"text": [f.read_text() for f in sorted(texts.iterdir())]})

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    ds = ds.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
    ds.save_to_disk(str(out))
    return time.perf_counter() - t0


def data_share(tok: Path, texts: Path, work: Path) -> dict:
    """A short training run on data prepared with the tokenizer: the ranks' data time per step."""
    from rayzero.config import load_config
    from rayzero.data.tokens import prepare
    from rayzero.jobs.train import run_train
    from transformers import AutoModelForCausalLM, LlamaConfig

    data = work / "train-data"
    prepare(texts, str(data), tokenizer=str(tok))
    model = work / "llama"
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(model))
    shutil.copy(tok / "tokenizer.json", model)
    shutil.copy(tok / "tokenizer_config.json", model)
    s = run_train(load_config(None, [
        "model.kind=hf", f"model.path={model}", "model.init=random", f"data.path={data}", "train.steps=20",
        "train.seq_len=256", "train.global_batch_size=16", "train.micro_batch_size=4", "tracking.enabled=false",
        f"train.output_dir={work / 'runs'}", "cluster.num_workers=2"]), progress=False)
    return {"step_ms": s["step_ms"], "data_ms": s["data_ms"], "share": s["data_ms"] / s["step_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-mb", type=float, default=20.0, help="MB of text to tokenize")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    import ray

    work = Path(tempfile.mkdtemp(prefix="rayzero-data-bench-"))
    try:
        texts, nbytes = corpus(work / "texts", args.max_mb)
        tok = train_tokenizer(texts, work / "tokenizer")
        print(f"{nbytes / 2**20:.1f} MB of text in {len(list(texts.iterdir()))} files; BPE of 8,192 ids\n")
        ray.init(num_cpus=2, logging_level="WARNING", log_to_driver=False)
        mbps: dict[str, list[float]] = {r: [] for r in RUNS}
        for rnd in range(args.rounds):
            order = RUNS[rnd % len(RUNS):] + RUNS[: rnd % len(RUNS)]
            for r in order:
                out = work / f"out-{rnd}-{r.replace(' ', '')}"
                if r == BASELINE:
                    s = run_datasets(texts, tok, out)
                else:
                    s = run_rayzero(texts, tok, out, use_ray=r.endswith("--ray"))
                mbps[r].append(nbytes / 2**20 / s)
                shutil.rmtree(out, ignore_errors=True)
                print(f"round {rnd + 1} {r:<16} {s:6.2f} s  {mbps[r][-1]:6.2f} MB/s", flush=True)
        base = statistics.median(mbps[BASELINE])
        print("\nmedian MB/s over rounds, and the ratio to datasets.map (target >= 1):")
        rows = {}
        for r in RUNS:
            m = statistics.median(mbps[r])
            rows[r] = {"mb_per_s": m, "ratio": m / base}
            print(f"  {r:<16} {m:6.2f} MB/s  {m / base:5.2f}x" + ("" if r == BASELINE else
                                                                  ("  PASS" if m >= base else "  FAIL")))
        ray.shutdown()
        share = data_share(tok, texts, work)
        print(f"\ntraining step {share['step_ms']:.0f} ms, data {share['data_ms']:.2f} ms: "
              f"{100 * share['share']:.2f}% of the step (target < 2%) {'PASS' if share['share'] < 0.02 else 'FAIL'}")
        if args.json:
            Path(args.json).write_text(json.dumps({"benchmark": "data", "mb": nbytes / 2**20, "rounds": args.rounds,
                                                   "mb_per_s": mbps, "summary": rows, "data_share": share}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
