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
from tests.dist.pool import spawn
from tests.dist.reference import train_reference, unpacked
from tests.dist.test_models import STEPS, assert_matches, run_ranks
from tests.models import save_hf_model, save_tokenizer

pytestmark = pytest.mark.slow

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
    """The whole global batch of a step, as one rank of one reads it: (inputs, labels), each
    example in a row of its own (the packed windows' per-example attention trains each alone)."""
    b = InstructionBatches(TokenDataset(data), seed=cfg.train.seed, global_batch=cfg.train.global_batch_size,
                           micro_batch=cfg.train.global_batch_size, seq_len=SEQ, dp_rank=0, dp_size=1)

    def batch(step):
        tokens, labels, documents = b.rank_rows(step)
        return unpacked(tokens[:, :-1], labels[:, 1:], documents[:, :-1])

    return batch


@pytest.mark.parametrize("world,accum", [(1, 2), (2, 2)])
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
    tokens, labels, _ = b.rank_rows(0)
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


def _eval_worker(rank: int, world: int, cfg, port: int, data: str, out: dict):
    from rayzero.cluster.schedule import evaluates, lr_at
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data)
    r.setup("127.0.0.1", port)
    vals = {}
    for step in range(STEPS):
        res = r.iteration({"step": step, "lr": lr_at(step, STEPS, cfg.optim),
                           "evaluate": evaluates(cfg, step)})
        if "val_loss_sum" in res:
            vals[step] = (res["val_loss_sum"], res["val_tokens"])
            assert r.strategy.ledger.transient == 0, "evaluation left parameters gathered"
    out[rank] = vals
    r.close()


@pytest.mark.parametrize("world,strategy", [(2, "optim"), (4, "optim_grads_params")])
def test_the_validation_loss_equals_a_single_process_computation(world, strategy, setup):
    """Held-out examples, evaluated every 2 steps and after the last, forward only: the loss the
    controller computes from the ranks' sums equals the reference model's on the same rows."""
    import torch.multiprocessing as mp
    import transformers as tf

    from rayzero.data.validation import ValidationRows
    from rayzero.data.validation import validation_split
    from tests.conftest import free_port

    model, data, meta = setup
    cfg = config(world, 1, model, [f"sharding.strategy={strategy}", "data.val_fraction=0.25", "train.eval_every=2",
                                   "train.eval_batches=3"])
    train, val = validation_split(cfg, TokenDataset(data))
    b = InstructionBatches(train, seed=cfg.train.seed, global_batch=4, micro_batch=4, seq_len=SEQ, dp_rank=0,
                           dp_size=1)
    ref = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    def batch(k):
        tokens, labels, documents = b.rank_rows(k)
        return unpacked(tokens[:, :-1], labels[:, 1:], documents[:, :-1])

    ref_state, _ = train_reference(ref, cfg, data, STEPS, batch=batch)
    rows = ValidationRows(val, seq_len=SEQ, global_batch=4, micro_batch=4, dp_rank=0, dp_size=1, max_batches=3)
    assert rows.num_batches == 3
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(rows.num_batches):
            (m,) = rows.microbatches(k)
            x, y = unpacked(m.tokens, m.targets, m.documents)
            total += torch.nn.functional.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten(), reduction="sum",
                                                       ignore_index=IGNORE_INDEX).item()
            count += int((y != IGNORE_INDEX).sum())
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_eval_worker, args=(world, cfg, free_port(), data, out), nprocs=world)
        out = dict(out)
    assert sorted(out[0]) == [1, STEPS - 1]
    got = sum(out[r][STEPS - 1][0] for r in range(world)) / sum(out[r][STEPS - 1][1] for r in range(world))
    assert sum(out[r][STEPS - 1][1] for r in range(world)) == count
    assert got == pytest.approx(total / count, rel=1e-5)
