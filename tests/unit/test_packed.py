"""Packed examples never see each other: through the model seam, the loss of a packed window
equals the sum of its examples' losses computed one by one, each alone in a row of its own (and
so do the gradients), for the built-in GPT, Hugging Face families (a Qwen2 chat model with its
chat template, Llama with a BOS, GPT-2's learned positions, a mixture of experts) and a user's
`nn.Module`; the data gives each token where its example starts; text documents stay apart
with `data.document_masking`; a model that cannot keep them apart is refused by name.
Under a context-parallel split: tests/dist/test_packed.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rayzero.config import ConfigError, load_config
from rayzero.data.batches import DocumentBatches
from rayzero.data.instruct import InstructionBatches
from rayzero.data.microbatch import MicroBatch
from rayzero.data.tokens import TokenDataset, prepare
from rayzero.models import ModelError
from rayzero.workers.assembly import make_spec
from tests.models import save_chat_model, save_hf_model, save_tokenizer

SEQ = 64
WORDS = Path(sys.modules["json"].__file__).read_text().split()


def chats(n: int) -> list[dict]:
    """Single- and two-turn conversations of a few words each."""
    out = []
    for i in range(n):
        a = (7 * i) % (len(WORDS) - 20)
        turns = [{"role": "user", "content": WORDS[a][:6] + " " * (i % 2) + WORDS[a + 1][:4] * (i % 2)},
                 {"role": "assistant", "content": WORDS[a + 5][:6]}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": WORDS[a + 9][:4]}, {"role": "assistant", "content": WORDS[a + 11][:4]}]
        out.append({"messages": turns})
    return out


def records(n: int) -> list[dict]:
    """Prompts and responses of a word or two: several examples to a window, in bytes too."""
    return [{"prompt": WORDS[i][:8] + (" " + WORDS[i + 1][:6]) * (i % 2) + ":",
             "response": " " + WORDS[i + 4][:8] + (" " + WORDS[i + 5][:5]) * (i % 3 == 0)}
            for i in range(0, 11 * n, 11)]


def instruction_data(root: Path, tokenizer: str, recs: list[dict]) -> TokenDataset:
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    prepare(root / "train.jsonl", str(root / "data"), tokenizer=tokenizer, instructions=True)
    return TokenDataset(str(root / "data"))


def windows(ds: TokenDataset, rows: int = 4, seq_len: int = SEQ) -> MicroBatch:
    """The first step's packed windows of `ds` (`rows` of them), as one micro-batch."""
    b = InstructionBatches(ds, seed=0, global_batch=rows, micro_batch=rows, seq_len=seq_len, dp_rank=0, dp_size=1)
    (batch,) = b.microbatches(0)
    b.close()
    return batch


def one_by_one(batch: MicroBatch) -> list[MicroBatch]:
    """Each example of the packed rows with a target in a row of its own: its tokens and targets
    alone (the padding after the last, an example with none, left out)."""
    out = []
    for r in range(batch.rows):
        for start in batch.documents[r].unique().tolist():
            keep = batch.documents[r] == start
            if (batch.targets[r][keep] != -100).any():
                out.append(MicroBatch(batch.tokens[r][keep][None], batch.targets[r][keep][None]))
    return out


def model_of(keys: list[str], seq_len: int = SEQ, mesh=None):
    """(the spec, its model with its initial values: a function of the seed and the names) of a
    config, in eval mode, in fp32; with `mesh`, as a rank assembles it before sharding (its
    context-parallel split)."""
    from rayzero.workers.assembly import build_model

    cfg = load_config(None, [*keys, f"train.seq_len={seq_len}"])
    spec = make_spec(cfg)
    model = spec.build() if mesh is None else build_model(cfg, spec, mesh).model
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.to_empty(device="cpu")
    for name, b in buffers.items():
        parent, _, leaf = name.rpartition(".")
        (model.get_submodule(parent) if parent else model)._buffers[leaf] = b
    source = spec.seeded(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            source.fill(n, p)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if hasattr(model, "lm_head") and hasattr(model, "wte"):
        model.lm_head.weight = model.wte.weight
    return spec, model.eval()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> tuple[str, TokenDataset]:
    """A Qwen2 chat model (ChatML's template and special tokens) and its conversations, prepared."""
    root = tmp_path_factory.mktemp("chat")
    model = save_chat_model(root / "qwen2", [Path(sys.modules["json"].__file__).read_text()])
    return str(model), instruction_data(root, str(model), chats(30))


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> dict[str, str]:
    """HF models of other families sharing one BPE tokenizer (a BOS on every example), and their data."""
    root = tmp_path_factory.mktemp("families")
    tok = save_hf_model("llama", root / "tok")
    save_tokenizer(tok, [Path(sys.modules["json"].__file__).read_text()], vocab=250)
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "add_bos_token": True}))
    dirs = {arch: str(save_hf_model(arch, root / arch, seed=i)) for i, arch in enumerate(("llama", "gpt2", "mixtral"))}
    return {**dirs, "data": str(instruction_data(root, str(tok), records(40)).uri)}


def assert_alone(spec, model, batch: MicroBatch, tol: float = 1e-5) -> None:
    """The packed rows' loss (and count, and gradients) are their examples' one by one."""
    assert batch.packed and len(one_by_one(batch)) > batch.rows, "the windows must pack several examples each"
    model.zero_grad()
    packed, count, _ = spec.loss(model, batch)
    packed.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone = [spec.loss(model, b) for b in one_by_one(batch)]
    total = sum(loss for loss, _, _ in alone)
    total.backward()
    assert int(count) == sum(int(n) for _, n, _ in alone) > 0
    assert float(packed) == pytest.approx(float(total), rel=tol)
    for n, p in model.named_parameters():
        if n in grads:
            err = ((grads[n] - p.grad).norm() / p.grad.norm().clamp(min=1e-30)).item()
            assert err < 100 * tol, (n, err)
    # without the documents the later examples see the earlier ones: the loss is another, by far more
    # than the packed one's rounding (a model at its initial values barely tells contexts apart)
    mixed, _, _ = spec.loss(model, MicroBatch(batch.tokens, batch.targets))
    assert abs(float(mixed) - float(total)) > 10 * max(abs(float(packed) - float(total)), 1e-6 * float(total))


def test_the_data_gives_each_token_where_its_example_starts(chat_model):
    _, ds = chat_model
    batch = windows(ds)
    for r in range(batch.rows):
        docs = batch.documents[r].tolist()
        starts = sorted(set(docs))
        assert starts[0] == 0 and docs == sorted(docs)  # examples are runs of the row, in order
        pos = batch.positions(torch.arange(SEQ))[r]
        assert all(pos[s] == 0 for s in starts)  # positions restart at every example
        # no target crosses from one example into the next: an example's first token is never a target
        assert all(batch.targets[r][s - 1] == -100 for s in starts if s > 0)


@pytest.mark.parametrize("kind", ["gpt", "module"])
def test_a_packed_windows_loss_is_its_examples_alone_gpt_and_module(kind, tmp_path):
    ds = instruction_data(tmp_path, "byte", records(40))
    keys = {"gpt": ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.vocab_size=259"],
            "module": ["model.kind=module", "model.factory=tests.models:TinyLM"]}[kind]
    spec, model = model_of(keys)
    assert_alone(spec, model, windows(ds))


def test_a_chat_models_packed_conversations_are_each_alone(chat_model):
    """A Qwen2 model with ChatML's template: transformers builds the block-diagonal mask from the
    position ids the seam gives (restarting at each conversation)."""
    path, ds = chat_model
    spec, model = model_of(["model.kind=hf", f"model.path={path}"])
    assert_alone(spec, model, windows(ds, seq_len=127))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_other_families_packed_examples_are_each_alone(arch, bpe_model):
    """Llama (rotary positions), GPT-2 (learned positions) and a mixture of experts (whose router
    sees each token whatever packs it)."""
    spec, model = model_of(["model.kind=hf", f"model.path={bpe_model[arch]}"])
    assert_alone(spec, model, windows(TokenDataset(bpe_model["data"])))


def test_text_documents_stay_apart_with_document_masking(tmp_path):
    """`data.document_masking`: a text window's documents are each alone (the one the window cut
    from its first token), and no target crosses from one into the next."""
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(30):
        (src / f"{i:02d}.txt").write_text(" ".join(WORDS[i * 5: i * 5 + 3 + i % 7]))
    prepare(src, str(tmp_path / "text"))
    ds = TokenDataset(str(tmp_path / "text"))
    b = DocumentBatches(ds, seed=1, global_batch=4, micro_batch=4, seq_len=SEQ, dp_rank=0, dp_size=1)
    tokens, labels, documents = b.rank_rows(0)
    (batch,) = b.microbatches(0)
    b.close()
    eot = int(ds.meta["eot"])
    for r in range(4):
        starts = sorted(set(documents[r].tolist()))
        # a document starts after each end-of-text token in the window
        assert starts[1:] == [t + 1 for t in np.flatnonzero(tokens[r].numpy() == eot).tolist() if t + 1 < SEQ + 1]
        assert all(labels[r][s] == -100 for s in starts[1:]) and (labels[r] != -100).sum() == SEQ + 2 - len(starts)
    spec, model = model_of(["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.vocab_size=259"])
    assert_alone(spec, model, batch)


def test_a_model_that_cannot_keep_examples_apart_is_refused_by_name(tmp_path):
    from rayzero.jobs.train import prepare_model

    cfg = load_config(None, ["model.kind=module", "model.factory=tests.models:Scaled", f"train.seq_len={SEQ}"])
    prepare_model(cfg)  # text, one sequence a row: fine
    with pytest.raises(ConfigError, match=r"model.factory=tests.models:Scaled: instruction data packs several examples "
                                        r"into each row, and Scaled.forward takes no `document_ids`"):
        prepare_model(cfg, packs="instruction data")
    ok = load_config(None, ["model.kind=module", "model.factory=tests.models:TinyLM", f"train.seq_len={SEQ}"])
    prepare_model(ok, packs="instruction data")


def test_a_family_that_builds_no_mask_from_positions_is_refused(tmp_path):
    """A state-space model (Mamba) has no attention mask to build from position ids."""
    import transformers as tf

    tf.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4).save_pretrained(tmp_path)
    spec = make_spec(load_config(None, ["model.kind=hf", f"model.path={tmp_path}"]))
    with pytest.raises(ModelError, match=r"instruction data packs several examples into each row, and MambaForCausalLM "
                                         r"does not build its attention mask from position_ids"):
        spec.check_documents(spec.build(), "instruction data")
