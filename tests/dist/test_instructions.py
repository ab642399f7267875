"""Instruction data trains sharded exactly as a single-process torch run with `ignore_index`:
an HF Llama with a BPE tokenizer trained here, prompt/response examples packed into windows
with the loss on response tokens only, at world 1, 2 and 4 under every strategy."""

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rayzero.config import load_config
from rayzero.data.instruct import IGNORE_INDEX, InstructionBatches
from rayzero.data.tokenizer import load_tokenizer
from rayzero.data.tokens import TokenDataset, prepare
from tests.dist.reference import train_reference
from tests.dist.test_models import STEPS, assert_matches, run_ranks
from tests.models import save_hf_model, save_tokenizer

SEQ = 48
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def examples(n: int, seed: int = 0) -> list[dict]:
    """Prompt/response pairs cut from the stdlib's source: lengths from a few tokens to more
    than a window (those are cut to it)."""
    words = Path(sys.modules["json"].__file__).read_text().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(len(words) - 80), rng.choice([2, 5, 9, 20, 60])
        out.append({"prompt": "Q: " + " ".join(words[a: a + rng.choice([1, 4, 12])]) + "\nA:",
                    "response": " " + " ".join(words[a + 12: a + 12 + b])})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruct")
    model = save_hf_model("llama", root / "llama", seed=3)
    save_tokenizer(model, [Path(sys.modules["json"].__file__).read_text()], vocab=300)
    (root / "train.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples(120)))
    meta = prepare(root / "train.jsonl", str(root / "data"), tokenizer=str(model), instructions=True)
    return str(model), str(root / "data"), meta


def config(world: int, accum: int, model: str, extra=()):
    return load_config(None, [
        f"cluster.num_workers={world}", "model.kind=hf", f"model.path={model}",
        f"train.seq_len={SEQ}", f"train.global_batch_size={4 * accum}", f"train.micro_batch_size={4 // world}",
        f"train.steps={STEPS}", "train.seed=11", "sharding.bucket_numel=3000", "sharding.shard_align=1",
        "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=3", "optim.weight_decay=0.1",
        "optim.grad_clip=0.5", *extra])


def global_batch(cfg, data: str):
    """The whole global batch of a step, as one rank of one reads it: (inputs, labels)."""
    b = InstructionBatches(TokenDataset(data), seed=cfg.train.seed, global_batch=cfg.train.global_batch_size,
                           micro_batch=cfg.train.global_batch_size, seq_len=SEQ, dp_rank=0, dp_size=1)

    def batch(step):
        tokens, labels = b.rank_rows(step)
        return tokens[:, :-1], labels[:, 1:]

    return batch


@pytest.mark.parametrize("world,accum", [(1, 2), (2, 2), (4, 1)])
def test_instruction_data_equals_plain_torch_with_ignore_index(world, accum, setup):
    import transformers as tf

    model, data, meta = setup
    base = config(world, accum, model)
    batch = global_batch(base, data)
    inputs, labels = batch(0)
    valid = int((labels != IGNORE_INDEX).sum())
    assert 0 < valid < 0.7 * labels.numel(), "prompts and padding must be masked for the test to mean anything"
    ref_state, ref_losses = train_reference(tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                            base, data, STEPS, batch=batch)
    strategies = STRATEGIES if world > 1 else ["no_shard"]
    runs = [(s, base.override(f"sharding.strategy={s}")) for s in strategies]
    results = run_ranks(world, runs, data)
    for label, _ in runs:
        assert_matches(results, label, world, ref_state, ref_losses)
        # the ranks counted exactly the response tokens of each step's windows, nothing else
        for k in range(STEPS):
            counted = sum(results[(label, r)]["losses"][k][1] for r in range(world))
            assert counted == int((batch(k)[1] != IGNORE_INDEX).sum()), (label, k)


def test_masked_tokens_take_no_part(setup):
    """Changing a prompt's target ids changes nothing: only response tokens are labels."""
    model, data, meta = setup
    cfg = config(1, 1, model)
    tok = load_tokenizer(model)
    b = InstructionBatches(TokenDataset(data), seed=cfg.train.seed, global_batch=4, micro_batch=4, seq_len=SEQ,
                           dp_rank=0, dp_size=1)
    tokens, labels = b.rank_rows(0)
    # every label is a response token (or the EOS after it): decoding the labels of a window
    # gives the responses of its examples, in order
    windows = b.epochs.step_windows(0)
    recs = examples(120)
    for row, ids in enumerate(windows):
        got = labels[row][labels[row] != IGNORE_INDEX].numpy()
        want = []
        for i in ids:
            r = np.asarray(tok.encode_batch([recs[i]["response"]])[0].tolist() + [tok.eos_id])
            p = tok.encode_batch([recs[i]["prompt"]])[0].size + (tok.bos_id is not None)
            want.append(r[: max(0, SEQ + 1 - p)])  # what survives an example cut to the window
        assert got.tolist() == np.concatenate(want).tolist(), row
