"""What keeping packed examples apart costs: a training micro-batch of packed instruction windows
with per-example attention (each token attends to its own example only, positions restarting
there) against the same windows as one sequence each (every token attending to the whole window,
as before), side by side in alternating rounds, at the same shape.

Each variant runs forward and backward of the model seam's loss on one micro-batch (what a
rank's forward and backward phases run), one torch thread (as a rank on this machine has), for
the built-in GPT (its own masks: SDPA with a boolean mask against SDPA's causal kernel) and an HF
Llama (transformers' block-diagonal mask from the position ids against its causal path). The
windows are packed first-fit from prompt/response examples of 20-400 bytes, bytes as tokens.

    python benchmarks/packed.py [--lengths 512 1024] [--rounds 3] [--iters 5] [--json PATH]

Prints, per model and window length: the examples a window holds on average, each variant's
median time (ms) over its rounds, and per-example / as-before as a ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MICRO = 4


def examples(n: int, seed: int = 0) -> list[dict]:
    """Prompt/response pairs cut from the standard library's source, 20-400 bytes each."""
    text = Path(json.__file__).read_text()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, p, r = rng.randrange(len(text) - 500), rng.randint(10, 120), rng.randint(10, 280)
        out.append({"prompt": text[a: a + p], "response": text[a + p: a + p + r]})
    return out


def windows(root: Path, length: int):
    from rayzero.data.instruct import InstructionBatches
    from rayzero.data.tokens import TokenDataset, prepare

    src = root / "ex.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps(e) + "\n" for e in examples(400)))
        prepare(src, str(root / "ex"), instructions=True)
    b = InstructionBatches(TokenDataset(str(root / "ex")), seed=0, global_batch=MICRO, micro_batch=MICRO,
                           seq_len=length, dp_rank=0, dp_size=1)
    (batch,) = b.microbatches(0)
    b.close()
    return batch


def model(kind: str, length: int, root: Path):
    """(the seam, the model with its seeded initial values) of `kind` for windows of `length`."""
    from tests.unit.test_packed import model_of

    if kind == "gpt":
        return model_of(["model.n_layer=2", "model.n_embd=128", "model.n_head=4", "model.vocab_size=257"], length)
    import transformers as tf

    path = root / f"llama-{length}"
    if not path.exists():
        tf.LlamaConfig(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length).save_pretrained(path)
    return model_of(["model.kind=hf", f"model.path={path}"], length)


def step_ms(spec, m, batch, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss, _, _ = spec.loss(m, batch)
        loss.backward()
        times.append((time.perf_counter() - t0) * 1e3)
        m.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    from rayzero.data.microbatch import MicroBatch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--models", nargs="+", default=["gpt", "llama"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for length in args.lengths:
            packed = windows(root, length)
            whole = MicroBatch(packed.tokens, packed.targets)  # the same windows, one sequence each
            per_window = sum(bool((packed.targets[r][packed.documents[r] == start] != -100).any())  # padding: no target
                             for r in range(packed.rows) for start in set(packed.documents[r].tolist())) / packed.rows
            for kind in args.models:
                spec, m = model(kind, length, root)
                step_ms(spec, m, packed, 2)  # warm up both paths
                step_ms(spec, m, whole, 2)
                times = {"per_example": [], "as_before": []}
                for _ in range(args.rounds):  # alternating
                    times["per_example"].append(step_ms(spec, m, packed, args.iters))
                    times["as_before"].append(step_ms(spec, m, whole, args.iters))
                med = {k: statistics.median(v) for k, v in times.items()}
                row = {"model": kind, "length": length, "examples_per_window": round(per_window, 1),
                       **{f"{k}_ms": round(v, 2) for k, v in med.items()},
                       "ratio": round(med["per_example"] / med["as_before"], 3),
                       "rounds": {k: [round(x, 2) for x in v] for k, v in times.items()}}
                rows.append(row)
                print(f"{kind:6s} {length:5d} tokens, {row['examples_per_window']:4.1f} examples a window: "
                      f"per-example {row['per_example_ms']:8.2f} ms, as before {row['as_before_ms']:8.2f} ms, "
                      f"ratio {row['ratio']:.3f}  (rounds {row['rounds']['per_example']} / {row['rounds']['as_before']})",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
