"""Real text: Hugging Face tokenizers trained here, sources of text, JSON lines and Parquet
(local and on S3), uint32 ids for large vocabularies, bad input, and the check that a
dataset fits the model's own tokenizer."""

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rayzero.config import load_config
from rayzero.data.errors import DataError
from rayzero.data.sources import Fields
from rayzero.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer
from rayzero.data.tokens import TokenDataset, prepare, read_meta
from rayzero.jobs.train import check_data_tokenizer
from tests.models import save_hf_model, save_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "def add(a, b):\n    return a + b  # ünïcödé\n",
    "naïve café — 日本語 🚀 emoji\n\nwith a blank line",
    "",
    "the end",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A byte-level BPE trained here, saved as a bare tokenizer.json."""
    d = tmp_path_factory.mktemp("bpe")
    save_tokenizer(d, DOCS * 20 + [Path(json.__file__).read_text()], vocab=400)
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, bpe_dir) -> Path:
    """The same tokenizer saved by transformers with BOS and EOS, adding BOS to every text (as Llama's)."""
    import transformers as tf

    tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tok.add_bos_token = True
    d = tmp_path_factory.mktemp("hf-tok")
    tok.save_pretrained(str(d))
    return d


def split_documents(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eos)
    return np.split(tokens, ends + 1)[:-1]


def write_docs(root: Path, docs=DOCS) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(docs):
        (root / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return root


# --------------------------------------------------------------------------- tokenizers

def test_a_bpe_tokenizer_prepares_documents_that_decode_back_to_the_text(tmp_path, bpe_dir):
    src = write_docs(tmp_path / "src")
    meta = prepare(src, str(tmp_path / "ds"), tokenizer=str(bpe_dir), row_group_tokens=4, shard_tokens=12)
    tok = load_tokenizer(str(bpe_dir))
    assert tok.eos_id == tok.tok.convert_tokens_to_ids("</s>")  # a bare tokenizer.json: EOS by its name
    assert tok.bos_id is None  # and it adds nothing itself
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.vocab_size == 400
    assert meta["tokenizer"]["sha256"] == tok.sha256 and meta["tokenizer"]["eos_id"] == tok.eos_id
    assert meta["tokenizer"]["special_tokens"] == {"</s>": tok.eos_id, "<s>": tok.tok.convert_tokens_to_ids("<s>")}
    assert len(meta["shards"]) > 2
    ds = TokenDataset(str(tmp_path / "ds"))
    tokens = ds.window(0, ds.num_tokens)
    docs = split_documents(tokens, tok.eos_id)
    assert len(docs) == meta["num_documents"] == len(DOCS)
    assert [tok.decode(d) for d in docs] == DOCS  # every document, in path order, each ending in EOS
    # the ids are the tokenizer's own
    assert docs[0][:-1].tolist() == tok.tok(DOCS[0], add_special_tokens=False)["input_ids"]


def test_a_tokenizer_that_adds_bos_starts_every_document_with_it(tmp_path, hf_dir):
    tok = HFTokenizer(hf_dir)
    assert tok.bos_id == tok.tok.bos_token_id is not None
    meta = prepare(write_docs(tmp_path / "src"), str(tmp_path / "ds"), tokenizer=str(hf_dir))
    tokens = TokenDataset(str(tmp_path / "ds")).window(0, meta["num_tokens"])
    docs = split_documents(tokens, tok.eos_id)
    assert all(d[0] == tok.bos_id for d in docs) and len(docs) == len(DOCS)
    assert [tok.decode(d) for d in docs] == DOCS
    assert meta["tokenizer"]["bos_id"] == tok.bos_id


def test_the_same_tokenizer_saved_twice_has_one_hash_and_another_has_another(tmp_path, bpe_dir, hf_dir):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(bpe_dir, copy)
    (copy / "tokenizer.json").write_text(json.dumps(json.loads((bpe_dir / "tokenizer.json").read_text()), indent=4))
    assert HFTokenizer(copy).sha256 == HFTokenizer(bpe_dir).sha256  # formatting is not the tokenizer
    assert HFTokenizer(hf_dir).sha256 != HFTokenizer(bpe_dir).sha256  # it adds BOS: it tokenizes otherwise
    other = tmp_path / "other"
    other.mkdir()
    save_tokenizer(other, ["something else entirely " * 50], vocab=300)
    assert HFTokenizer(other).sha256 != HFTokenizer(bpe_dir).sha256


def test_a_vocabulary_above_65536_ids_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    words.update({"[UNK]": 70_000, "</s>": 70_001})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    d = tmp_path / "big"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    text = "w1 w65535 w65536 w69999 nope w0"
    (tmp_path / "a.txt").write_text(text)
    meta = prepare(tmp_path / "a.txt", str(tmp_path / "ds"), tokenizer=str(d))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    assert pq.read_schema(tmp_path / "ds" / meta["shards"][0]["file"]).field("tokens").type == pa.uint32()
    got = TokenDataset(str(tmp_path / "ds")).window(0, meta["num_tokens"])
    assert got.tolist() == [1, 65535, 65536, 69999, 70_000, 0, 70_001]


def test_bytes_stay_what_they_were(tmp_path):
    """The byte tokenizer writes what version 1 wrote (same ids, same fingerprint), and a
    version-1 dataset still reads, as bytes."""
    src = write_docs(tmp_path / "src")
    meta = prepare(src, str(tmp_path / "ds"))
    want = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 256) for t in DOCS]).astype(np.uint16)
    import hashlib

    h = hashlib.sha256()
    for t in DOCS:
        h.update(np.append(np.frombuffer(t.encode(), np.uint8).astype(np.uint16), np.uint16(256)).tobytes())
    assert meta["fingerprint"] == h.hexdigest()[:16] and meta["tokenizer"]["kind"] == "byte"
    ds = TokenDataset(str(tmp_path / "ds"))
    assert ds.window(0, ds.num_tokens).tolist() == want.tolist()
    v1 = {k: meta[k] for k in ("vocab_size", "eot", "num_tokens", "num_documents", "shards", "fingerprint", "source")}
    (tmp_path / "ds" / "meta.json").write_text(json.dumps({"format": "rayzero-tokens", "version": 1, **v1}))
    old = read_meta(str(tmp_path / "ds"))
    assert old["tokenizer"] == ByteTokenizer().record() and old["dtype"] == "uint16"
    assert TokenDataset(str(tmp_path / "ds")).window(0, ds.num_tokens).tolist() == want.tolist()


# --------------------------------------------------------------------------- sources

def test_json_lines_parquet_and_globs(tmp_path, bpe_dir):
    (tmp_path / "in").mkdir()
    lines = [json.dumps({"id": i, "body": t}) for i, t in enumerate(DOCS)]
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines[:3]) + "\n\n")
    (tmp_path / "in" / "b.json").write_text(json.dumps([json.loads(x) for x in lines[3:]]))
    pq.write_table(pa.table({"content": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "in" / "c.parquet",
                   row_group_size=2)
    (tmp_path / "in" / "notes.md").write_text("not matched by the glob")
    meta = prepare(str(tmp_path / "in" / "*.json*"), str(tmp_path / "js"), fields=Fields(text_field="body"))
    assert meta["num_documents"] == len(DOCS)
    tokens = TokenDataset(str(tmp_path / "js")).window(0, meta["num_tokens"])
    assert [ByteTokenizer().decode(d) for d in split_documents(tokens, 256)] == DOCS
    meta = prepare(str(tmp_path / "in" / "c.parquet"), str(tmp_path / "pq"), tokenizer=str(bpe_dir),
                   fields=Fields(text_column="content"))
    tok = load_tokenizer(str(bpe_dir))
    tokens = TokenDataset(str(tmp_path / "pq")).window(0, meta["num_tokens"])
    assert [tok.decode(d) for d in split_documents(tokens, tok.eos_id)] == DOCS


def test_sources_in_s3(tmp_path, s3_server, monkeypatch, bpe_dir):
    for k, v in {"AWS_ACCESS_KEY_ID": s3_server.KEY, "AWS_SECRET_ACCESS_KEY": s3_server.SECRET,
                 "AWS_DEFAULT_REGION": s3_server.REGION, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(k, v)
    fs = s3_server.fs()
    fs.create_dir("texts")
    for i, t in enumerate(DOCS):
        with fs.open_output_stream(f"texts/docs/{i:02d}.jsonl") as f:
            f.write(json.dumps({"text": t}).encode() + b"\n")
    local = tmp_path / "local.jsonl"
    local.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    meta = prepare("s3://texts/docs/*.jsonl", "s3://texts/tokens", tokenizer=str(bpe_dir))
    want = prepare(local, str(tmp_path / "ds"), tokenizer=str(bpe_dir))
    assert meta["num_documents"] == len(DOCS) and meta["fingerprint"] == want["fingerprint"]
    assert read_meta("s3://texts/tokens")["num_tokens"] == want["num_tokens"]
    assert TokenDataset("s3://texts/tokens").window(0, 5).tolist() == TokenDataset(str(tmp_path / "ds")).window(0, 5).tolist()


# --------------------------------------------------------------------------- bad input

def test_a_record_without_the_field_names_the_file_and_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"text": "one"}\n{"text": "two"}\n\n{"body": "three"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:4: no field .text. \(it has: body\); name the text with --text-field"):
        prepare(f, str(tmp_path / "ds"))
    f.write_text('{"text": "one"}\n{"text": "two\n')
    with pytest.raises(DataError, match=r"data\.jsonl:2: not valid JSON"):
        prepare(f, str(tmp_path / "ds"))
    f.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:1: field 'text' is int, not a string"):
        prepare(f, str(tmp_path / "ds"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: no column 'text' \(it has: body\)"):
        prepare(tmp_path / "t.parquet", str(tmp_path / "ds"))


def test_text_that_is_not_utf8_is_named_and_skipped_or_refused(tmp_path, caplog):
    src = write_docs(tmp_path / "src", ["fine\n", "also fine\n"])
    (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (src / "lines.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": "ok too"}\n')
    with caplog.at_level(logging.WARNING):
        meta = prepare(src, str(tmp_path / "ds"))
    assert meta["num_skipped"] == 2 and meta["num_documents"] == 4
    assert meta["skipped"] == [str(src / "latin1.txt"), f"{src / 'lines.jsonl'}:2"]
    assert "latin1.txt: not UTF-8" in caplog.text and "lines.jsonl:2: not UTF-8" in caplog.text
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8"):
        prepare(src, str(tmp_path / "strict"), strict_utf8=True)


def test_an_interrupted_prepare_never_looks_complete(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n' * 3)
    prepare(good, str(tmp_path / "ds"))
    assert read_meta(str(tmp_path / "ds"))["num_documents"] == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n' * 1000 + '{"oops": 1}\n')
    with pytest.raises(DataError, match=":1001:"):
        prepare(bad, str(tmp_path / "ds"), shard_tokens=64)  # shards were written before the failure
    assert read_meta(str(tmp_path / "ds"))["num_documents"] == 3, "the dataset there is replaced only at the commit"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "ds", "good.jsonl"], "nothing else left"
    with pytest.raises(DataError, match=":1001:"):
        prepare(bad, str(tmp_path / "new"), shard_tokens=64)
    with pytest.raises(DataError, match="no dataset at"):
        read_meta(str(tmp_path / "new"))
    assert not (tmp_path / "new").exists()


def test_tokenizers_that_load_nothing(tmp_path):
    with pytest.raises(TokenizerError, match="no such directory"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="holds no tokenizer files"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match="loads nothing"):
        load_tokenizer(str(tmp_path / "broken"))
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "nothing-here", str(tmp_path / "ds"))


# --------------------------------------------------------------------------- the dataset fits the model

def test_training_refuses_a_dataset_made_with_another_tokenizer(tmp_path, bpe_dir):
    import shutil

    model = save_hf_model("llama", tmp_path / "llama", vocab_size=512)
    for f in bpe_dir.iterdir():
        shutil.copy(f, model)
    cfg = load_config(None, ["model.kind=hf", f"model.path={model}"])
    src = write_docs(tmp_path / "src")
    by_bytes = prepare(src, str(tmp_path / "bytes"))
    with pytest.raises(DataError, match=r"tokenized with bytes, not with the tokenizer of model\.path .*"
                                        r"--tokenizer"):
        check_data_tokenizer(cfg, by_bytes, str(tmp_path / "bytes"))
    other = tmp_path / "other"
    other.mkdir()
    save_tokenizer(other, ["something else entirely " * 50], vocab=300)
    by_other = prepare(src, str(tmp_path / "other-ds"), tokenizer=str(other))
    with pytest.raises(DataError, match="tokenized with tokenizer other"):
        check_data_tokenizer(cfg, by_other, str(tmp_path / "other-ds"))
    # the model's own tokenizer, whichever copy of it the data was made with, passes
    check_data_tokenizer(cfg, prepare(src, str(tmp_path / "own"), tokenizer=str(model)), str(tmp_path / "own"))
    check_data_tokenizer(cfg, prepare(src, str(tmp_path / "same"), tokenizer=str(bpe_dir)), str(tmp_path / "same"))
    # a model directory without a tokenizer checks only the vocabulary (elsewhere)
    bare = save_hf_model("llama", tmp_path / "bare")
    check_data_tokenizer(load_config(None, ["model.kind=hf", f"model.path={bare}"]), by_bytes, "x")


# --------------------------------------------------------------------------- instruction data

from rayzero.data.instruct import IGNORE_INDEX, Epochs, InstructionBatches, pack  # noqa: E402

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_packing_fills_windows_in_order_without_splitting_an_example():
    lengths = np.array([5, 3, 9, 2, 12, 1])
    assert pack(lengths, np.arange(6), 10) == [[0, 1], [2], [3], [4], [5]]
    assert pack(lengths, np.array([5, 3, 1, 0]), 10) == [[5, 3, 1], [0]]
    ep = Epochs(np.array([4] * 7), seed=0, global_batch=2, window=9)  # 2 examples a window: 4 windows
    assert ep.truncated == 0 and ep.steps_in(0) == 2
    first = ep.step_windows(0) + ep.step_windows(1)
    assert sorted(i for w in first for i in w) == list(range(7))  # each example once per epoch
    assert ep.locate(2) == (1, 0) and ep.steps(3) == 6
    assert sorted(i for k in (2, 3) for w in ep.step_windows(k) for i in w) == list(range(7))
    assert ep.step_windows(1)[-1] == [] or len(ep.windows(0)) % 2 == 0  # the last step is filled up
    assert ep.windows(0) != ep.windows(1)  # another order each epoch


def instruct_dataset(tmp_path, tok: str, records: list[dict]) -> str:
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare(f, str(tmp_path / "ds"), tokenizer=tok, instructions=True, row_group_tokens=16)
    return str(tmp_path / "ds")


def test_prompt_response_labels_are_the_response_and_never_cross_examples(tmp_path, hf_dir):
    recs = [{"prompt": f"question {i}: " + "why " * i, "response": f"answer {i} " + "because " * (i % 3)}
            for i in range(12)]
    data = instruct_dataset(tmp_path, str(hf_dir), recs)
    meta = read_meta(data)
    tok = HFTokenizer(hf_dir)
    assert meta["kind"] == "instructions" and meta["num_documents"] == 12
    ds = TokenDataset(data)
    assert ds.document_lengths.sum() == ds.num_tokens
    b = InstructionBatches(ds, seed=3, global_batch=4, micro_batch=4, seq_len=24, dp_rank=0, dp_size=1)
    for step in range(6):
        tokens, labels, documents = b.rank_rows(step)
        for row, ids in enumerate(b.epochs.step_windows(step)):
            want_tokens, want_labels, want_docs = [], [], []
            for i in ids:
                p, r = tok.encode_batch([recs[i]["prompt"], recs[i]["response"]])
                ex = [tok.bos_id, *p.tolist(), *r.tolist(), tok.eos_id][:25]
                want_docs += [len(want_tokens)] * len(ex)  # each token: where its example starts
                want_tokens += ex
                want_labels += [IGNORE_INDEX] * (1 + p.size) + [*r.tolist(), tok.eos_id]
                want_labels = want_labels[: len(want_tokens)]
            pad = 25 - len(want_tokens)
            assert tokens[row].tolist() == want_tokens + [tok.eos_id] * pad
            assert labels[row].tolist() == want_labels + [IGNORE_INDEX] * pad
            assert documents[row].tolist() == want_docs + [len(want_tokens)] * pad  # the padding: one of its own
    # rank r of d reads rows [r B/d, (r+1) B/d) of the same windows: any world size, same step
    whole = b.rank_rows(4)
    for d in (2, 4):
        parts = [InstructionBatches(ds, seed=3, global_batch=4, micro_batch=4 // d, seq_len=24, dp_rank=r,
                                    dp_size=d).rank_rows(4) for r in range(d)]
        for i in range(3):
            assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])


def test_chat_messages_learn_the_assistant_turns_only(tmp_path, bpe_dir):
    import transformers as tf

    tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"), eos_token="</s>")
    tok.chat_template = CHAT
    d = tmp_path / "chat-tok"
    tok.save_pretrained(str(d))
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "the end"}]
    data = instruct_dataset(tmp_path, str(d), [{"messages": conv}])
    ids, mask = TokenDataset(data).window_with_mask(0, read_meta(data)["num_tokens"])
    mine = HFTokenizer(d)
    assert mine.decode(ids[mask == 1]) == "hello therethe end"  # each turn with its </s>, nothing else
    assert tok.decode(ids[mask == 1].tolist()) == "hello there</s>the end</s>"
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(conv, tokenize=False)
    with pytest.raises(DataError, match=r"chat\.jsonl:1: no assistant message"):
        instruct_dataset(tmp_path, str(d), [{"messages": conv[:2]}])
    with pytest.raises(DataError, match="need a tokenizer with a chat template"):
        instruct_dataset(tmp_path, "byte", [{"messages": conv}])
    with pytest.raises(DataError, match=r"chat\.jsonl:1: an instruction record has `prompt` and `response`"):
        instruct_dataset(tmp_path, "byte", [{"question": "x"}])


# --------------------------------------------------------------------------- validation

from rayzero.data.batches import RankBatches  # noqa: E402
from rayzero.data.validation import ValidationRows, held_out, split  # noqa: E402


def numbered_docs(tmp_path, n: int, length: int) -> str:
    """`n` documents of `length` bytes, document i made of byte 32 + i only: a token tells its document."""
    src = tmp_path / "numbered"
    src.mkdir()
    for i in range(n):
        (src / f"{i:03d}.txt").write_text(chr(32 + i) * length)
    prepare(src, str(tmp_path / "ds"), row_group_tokens=32)
    return str(tmp_path / "ds")


def test_whole_documents_are_held_out_the_same_for_every_seed(tmp_path):
    ds = TokenDataset(numbered_docs(tmp_path, 40, 50))
    assert ds.document_lengths.tolist() == [51] * 40
    train, val = split(ds, 0.2)
    held = held_out(40, 0.2, "x")
    assert held.sum() == 8 and np.array_equal(held, held_out(40, 0.2, "y"))
    val_docs = {chr(32 + i) for i in np.flatnonzero(held)}
    text = ByteTokenizer().decode(val.window(0, val.num_tokens))
    assert set(text) == val_docs and val.num_tokens == 8 * 51
    # training windows, at any seed and step, hold no token of a held-out document
    for seed in range(3):
        b = RankBatches(train, seed=seed, global_batch=8, micro_batch=8, seq_len=60, dp_rank=0, dp_size=1)
        for step in range(5):
            seen = {chr(t) for t in b.rank_rows(step).flatten().tolist() if t < 256}
            assert not seen & val_docs
    assert train.fingerprint != ds.fingerprint  # a resume with another split is refused
    with pytest.raises(DataError, match=r"val_fraction=0.01 of the 40 documents .* holds out none"):
        split(ds, 0.01)
    with pytest.raises(DataError, match="leaves none to train on"):
        split(ds, 0.999)


def test_a_v1_dataset_finds_its_documents_by_end_of_text(tmp_path):
    data = numbered_docs(tmp_path, 5, 30)
    (Path(data) / "documents.parquet").unlink()
    assert TokenDataset(data).document_lengths.tolist() == [31] * 5


def test_validation_rows_are_the_same_at_any_world_size(tmp_path):
    ds = TokenDataset(numbered_docs(tmp_path, 10, 100))
    rows = {}
    for d in (1, 2, 4):
        parts = [ValidationRows(ds, seq_len=15, global_batch=8, micro_batch=2 if d < 4 else 1, dp_rank=r, dp_size=d,
                                max_batches=9) for r in range(d)]
        assert parts[0].num_rows == 1010 // 16 and parts[0].num_batches == 8  # 63 rows: the last batch half padding
        rows[d] = [torch.cat([torch.cat([m.targets for m in p.microbatches(b)]) for p in parts]) for b in range(8)]
    for b in range(8):
        assert torch.equal(rows[1][b], rows[2][b]) and torch.equal(rows[1][b], rows[4][b])
    last = rows[1][7]
    assert (last[7] == IGNORE_INDEX).all() and (last[6] != IGNORE_INDEX).all()


def test_data_epochs_alone_set_the_length_and_with_train_steps_the_earlier_ends_it(tmp_path):
    from rayzero.jobs.data_checks import run_length
    from rayzero.jobs.train import steps_in_epochs

    recs = [{"prompt": f"p{i} " * (i % 4 + 1), "response": f"r{i} " * (i % 5 + 1)} for i in range(30)]
    data = instruct_dataset(tmp_path, "byte", recs)
    keys = ["train.seq_len=31", "train.global_batch_size=4", "train.micro_batch_size=2"]
    cfg = load_config(None, [*keys, "train.steps=100", "data.epochs=2"])
    ep = Epochs(TokenDataset(data).document_lengths, 0, 4, 32)
    assert steps_in_epochs(cfg, data) == ep.steps_in(0) + ep.steps_in(1) < 100
    done, words, key = run_length(cfg, data)
    assert done.train.steps == steps_in_epochs(cfg, data)
    assert words == f"data.epochs=2 ({done.train.steps} steps) ends the run before train.steps=100" and key.startswith("data.epochs")
    done, words, key = run_length(cfg.override("train.steps=3"), data)  # the steps come first
    assert done.train.steps == 3 and words.startswith("train.steps=3 ends the run before data.epochs=2") and key == "train.steps=3"
    assert run_length(cfg.override("data.epochs=0"), data)[:2] == (cfg.override("data.epochs=0"), None)
    # data.epochs alone: the run is as long as its epochs, past the default 100 steps, and the schedule follows it
    alone = load_config(None, [*keys, "data.epochs=20"])
    done, words, _ = run_length(alone, data)
    assert done.train.steps == ep.steps(20) > 100 and words.endswith("sets the run's length; the schedule follows it")
    # text: as many tokens as the dataset holds
    text = prepare(write_docs(tmp_path / "src"), str(tmp_path / "text"))
    steps = steps_in_epochs(cfg.override("data.epochs=1"), str(tmp_path / "text"))
    assert steps == -(-text["num_tokens"] // (4 * 31))


def test_relative_data_paths_are_made_absolute_for_ranks_in_another_directory(tmp_path, monkeypatch):
    """Ranks on a cluster started elsewhere read `data.path` and `data.val_path` where the driver
    found them (the README's `data.path=data/notes` on a running cluster)."""
    from rayzero.jobs.train import absolute_data_paths

    monkeypatch.chdir(tmp_path)
    cfg = absolute_data_paths(load_config(None, ["data.path=data/notes", "data.val_path=s3://bucket/val"]))
    assert cfg.data.path == str(tmp_path / "data" / "notes") and cfg.data.val_path == "s3://bucket/val"
    assert absolute_data_paths(load_config(None, [])).data.path == ""  # the default corpus
