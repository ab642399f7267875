"""Token datasets: preparing shards from text, reading windows back, and which rows each rank reads."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rayzero.data.corpus as corpus
from rayzero.data.batches import RankBatches, global_batch_offsets
from rayzero.data.corpus import ensure_default_corpus
from rayzero.data.tokens import EOT, DataError, TokenDataset, decode, encode, prepare, read_meta

FAST = settings(max_examples=100, deadline=None)

ROW_GROUP = 64
SHARD = 400

# Names chosen so that path order and plain string order agree.
DOCS = {
    "a_intro.txt": "Hello, world!\n" * 7,
    "b_unicode.txt": "héllo wörld — naïve café, 日本語, emoji 🚀🐍, Ελληνικά\n" * 5,
    "c_empty.txt": "",
    "d_code.txt": "def f(x):\n    return x * 2  # ünïcödé comment\n" * 9,
    "z_sub/e_nested.txt": "nested file in a folder\n" * 11,
    "z_sub/f_last.txt": "the end\n",
}
NOT_UTF8 = {"c_latin1.txt": "caf\xe9 cr\xe8me".encode("latin-1"), "d_binary.txt": b"\xff\xfe\x00\x80 bytes"}


def write_tree(root: Path, texts: dict[str, str], raw: dict[str, bytes] = {}) -> Path:
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text.encode("utf-8"))
    for name, data in raw.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def expected_tokens(texts: dict[str, str]) -> np.ndarray:
    """Each document's bytes followed by EOT, in sorted path order."""
    parts = []
    for name in sorted(texts):
        parts.append(np.frombuffer(texts[name].encode("utf-8"), dtype=np.uint8).astype(np.int64))
        parts.append(np.array([EOT], dtype=np.int64))
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    src = write_tree(tmp_path_factory.mktemp("src"), DOCS, NOT_UTF8)
    out = str(tmp_path_factory.mktemp("ds") / "tokens")
    meta = prepare(src, out, row_group_tokens=ROW_GROUP, shard_tokens=SHARD)
    return out, meta, expected_tokens(DOCS)


# --------------------------------------------------------------------------- encode / decode


@FAST
@given(st.text(st.characters(codec="utf-8")))
def test_encode_decode_round_trips_any_text(text):
    tokens = encode(text)
    assert tokens.dtype == np.uint16
    assert len(tokens) == len(text.encode("utf-8"))
    assert (tokens < 256).all()
    assert decode(tokens) == text


def test_non_ascii_text_encodes_to_its_utf8_bytes():
    text = "naïve 日本 🚀"
    assert encode(text).tolist() == list(text.encode("utf-8"))
    assert decode(encode(text).tolist()) == text


def test_decode_drops_end_of_text_between_documents():
    tokens = np.concatenate([encode("héllo"), [EOT], encode(" wörld"), [EOT]])
    assert decode(tokens) == "héllo wörld"


# --------------------------------------------------------------------------- prepare / meta


def test_shards_and_row_groups_are_split_small(prepared):
    out, meta, _ = prepared
    # the test windows below only mean something if they cross both kinds of boundary
    assert len(meta["shards"]) >= 3
    for s in meta["shards"]:
        f = pq.ParquetFile(os.path.join(out, s["file"]))
        assert f.metadata.num_rows == s["num_tokens"]
        assert f.num_row_groups == -(-s["num_tokens"] // ROW_GROUP)
    assert sum(pq.ParquetFile(os.path.join(out, s["file"])).num_row_groups for s in meta["shards"]) > 10


def test_meta_counts_every_token_and_utf8_document(prepared):
    out, meta, expected = prepared
    assert read_meta(out) == meta
    on_disk = json.loads(Path(out, "meta.json").read_text())
    assert on_disk == meta
    assert meta["num_tokens"] == sum(s["num_tokens"] for s in meta["shards"]) == len(expected)
    assert meta["num_documents"] == len(DOCS)  # the non-UTF-8 files are not counted
    assert meta["eot"] == EOT
    assert meta["vocab_size"] == 257
    assert [s["file"] for s in meta["shards"]] == [f"shard-{i:05d}.parquet" for i in range(len(meta["shards"]))]


def test_whole_dataset_is_the_documents_in_sorted_order_each_ending_in_eot(prepared):
    out, meta, expected = prepared
    ds = TokenDataset(out)
    assert ds.num_tokens == len(expected)
    got = ds.window(0, ds.num_tokens)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)
    assert decode(got) == "".join(DOCS[n] for n in sorted(DOCS))
    assert (got == EOT).sum() == len(DOCS)


@FAST
@given(data=st.data())
def test_any_window_is_the_same_slice_of_the_concatenation(prepared, data):
    out, _, expected = prepared
    ds = TokenDataset(out, cache_row_groups=data.draw(st.sampled_from([1, 2, 1024])))
    start = data.draw(st.integers(0, len(expected)))
    length = data.draw(st.integers(0, len(expected) - start))
    np.testing.assert_array_equal(ds.window(start, length), expected[start : start + length])


def test_windows_across_shard_boundaries(prepared):
    out, meta, expected = prepared
    ds = TokenDataset(out)
    boundary = 0
    for s in meta["shards"][:-1]:
        boundary += s["num_tokens"]
        for start, length in [(boundary - 1, 2), (boundary - ROW_GROUP - 3, 2 * ROW_GROUP + 7), (boundary, 1)]:
            np.testing.assert_array_equal(ds.window(start, length), expected[start : start + length])


def test_windows_outside_the_dataset_raise_index_error(prepared):
    out, _, expected = prepared
    ds = TokenDataset(out)
    n = len(expected)
    np.testing.assert_array_equal(ds.window(n - 5, 5), expected[-5:])
    for start, length in [(-1, 2), (n - 4, 5), (n, 1), (n + 10, 1), (0, n + 1)]:
        with pytest.raises(IndexError):
            ds.window(start, length)


def test_non_utf8_files_are_skipped(tmp_path):
    src = write_tree(tmp_path / "src", {"a.txt": "kept"}, {"b.txt": b"\xc3\x28 broken", "c.bin": bytes(range(256))})
    meta = prepare(src, str(tmp_path / "out"))
    assert meta["num_documents"] == 1
    np.testing.assert_array_equal(TokenDataset(str(tmp_path / "out")).window(0, 5), expected_tokens({"a.txt": "kept"}))


def test_pattern_and_exclude_choose_the_files(tmp_path):
    texts = {"a.py": "x = 1\n", "lib/b.py": "y = 2\n", "notes.txt": "skip me", "site-packages/c.py": "z = 3\n"}
    src = write_tree(tmp_path / "src", texts)
    meta = prepare(src, str(tmp_path / "out"), pattern="*.py", exclude=("site-packages",))
    kept = {k: texts[k] for k in ("a.py", "lib/b.py")}
    assert meta["num_documents"] == 2
    ds = TokenDataset(str(tmp_path / "out"))
    np.testing.assert_array_equal(ds.window(0, ds.num_tokens), expected_tokens(kept))


def test_a_single_file_source_is_one_document(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("just one ✓")
    meta = prepare(f, str(tmp_path / "out"))
    assert meta["num_documents"] == 1
    assert meta["num_tokens"] == len("just one ✓".encode()) + 1


def test_fingerprint_follows_content(tmp_path):
    a = prepare(write_tree(tmp_path / "a", {"x.txt": "same"}), str(tmp_path / "oa"))
    b = prepare(write_tree(tmp_path / "b", {"y.txt": "same"}), str(tmp_path / "ob"))
    c = prepare(write_tree(tmp_path / "c", {"x.txt": "diff"}), str(tmp_path / "oc"))
    assert a["fingerprint"] == b["fingerprint"] != c["fingerprint"]


def test_missing_dataset_folder_names_its_path(tmp_path):
    missing = tmp_path / "no" / "such" / "dataset"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        TokenDataset(str(missing))
    with pytest.raises(DataError, match=re.escape(str(missing))):
        read_meta(str(missing))


def test_folder_without_meta_is_not_a_dataset(tmp_path):
    src = write_tree(tmp_path / "src", {"a.txt": "hello"})
    out = tmp_path / "interrupted"
    prepare(src, str(out))
    (out / "meta.json").unlink()  # as if prepare died before its commit
    assert list(out.glob("shard-*.parquet"))
    with pytest.raises(DataError, match=re.escape(str(out / "meta.json"))):
        TokenDataset(str(out))


def test_meta_of_another_format_is_rejected(tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    (out / "meta.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(DataError, match="meta.json"):
        read_meta(str(out))


@pytest.mark.parametrize(
    "texts,raw",
    [({}, {}), ({"a.md": "not matched"}, {}), ({}, {"a.txt": b"\xff\xff\xff"})],
    ids=["empty-folder", "nothing-matches", "only-non-utf8"],
)
def test_a_source_without_usable_text_raises(tmp_path, texts, raw):
    src = tmp_path / "src"
    src.mkdir()
    write_tree(src, texts, raw)
    with pytest.raises(DataError):
        prepare(src, str(tmp_path / "out"), pattern="*.txt")
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_missing_source_raises(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "nope", str(tmp_path / "out"))


# --------------------------------------------------------------------------- global batches

SEQ = 16


@pytest.fixture(scope="module")
def batch_ds(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "δέλτα", "ε", "zeta", "ηta", "θ", "\n"]
    texts = {f"doc{i:02d}.txt": " ".join(rng.choice(words, size=300)) for i in range(12)}
    src = write_tree(tmp_path_factory.mktemp("bsrc"), texts)
    out = str(tmp_path_factory.mktemp("bds") / "tokens")
    prepare(src, out, row_group_tokens=256, shard_tokens=2000)
    return TokenDataset(out)


@pytest.fixture(scope="module")
def other_ds(tmp_path_factory):
    src = write_tree(tmp_path_factory.mktemp("osrc"), {"x.txt": "a different corpus " * 200})
    out = str(tmp_path_factory.mktemp("ods") / "tokens")
    prepare(src, out)
    return TokenDataset(out)


@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    step=st.integers(0, 10**6),
    batch=st.integers(1, 64),
    num_tokens=st.integers(2, 10**7),
    seq_len=st.integers(1, 1024),
)
def test_offsets_are_a_function_of_seed_step_and_batch_and_in_range(seed, step, batch, num_tokens, seq_len):
    if seq_len >= num_tokens:
        seq_len = num_tokens - 1
    a = global_batch_offsets(seed, step, batch, num_tokens, seq_len)
    b = global_batch_offsets(seed, step, batch, num_tokens, seq_len)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (batch,) and a.dtype == np.int64
    # every window of seq_len + 1 tokens (inputs plus the shifted target) fits
    assert (a >= 0).all() and (a + seq_len + 1 <= num_tokens).all()


def test_offsets_differ_between_steps_and_seeds():
    base = global_batch_offsets(0, 0, 32, 10**6, 128)
    assert not np.array_equal(base, global_batch_offsets(0, 1, 32, 10**6, 128))
    assert not np.array_equal(base, global_batch_offsets(1, 0, 32, 10**6, 128))
    steps = {tuple(global_batch_offsets(7, s, 8, 10**6, 128)) for s in range(50)}
    assert len(steps) == 50


def rank_batches(ds, dp_rank, dp_size, global_batch=24, micro=2, seed=3):
    return RankBatches(
        ds, seed=seed, global_batch=global_batch, micro_batch=micro, seq_len=SEQ, dp_rank=dp_rank, dp_size=dp_size
    )


@pytest.mark.parametrize("step", [0, 5])
def test_global_batch_is_the_same_at_every_world_size(batch_ds, step):
    offsets = global_batch_offsets(3, step, 24, batch_ds.num_tokens, SEQ)
    expected = np.stack([batch_ds.window(int(o), SEQ + 1) for o in offsets])
    for d in (1, 2, 3, 4, 6):
        parts = [rank_batches(batch_ds, r, d).rank_rows(step) for r in range(d)]
        for p in parts:
            assert p.shape == (24 // d, SEQ + 1) and p.dtype == torch.int64
        np.testing.assert_array_equal(torch.cat(parts).numpy(), expected, err_msg=f"dp_size={d}")


@pytest.mark.parametrize("dp_size,micro", [(1, 1), (2, 3), (3, 2), (4, 6), (6, 4)])
def test_microbatches_are_rows_split_into_inputs_and_shifted_targets(batch_ds, dp_size, micro):
    for r in range(dp_size):
        rb = rank_batches(batch_ds, r, dp_size, micro=micro)
        rows = rb.rank_rows(2)
        mbs = rb.microbatches(2)
        assert len(mbs) == rb.num_microbatches == 24 // (micro * dp_size)
        for b in mbs:
            x, y = b.tokens, b.targets
            assert x.shape == y.shape == (micro, SEQ) and b.documents is None  # a window is one sequence
            assert x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(torch.cat([b.tokens for b in mbs]), rows[:, :-1])
        assert torch.equal(torch.cat([b.targets for b in mbs]), rows[:, 1:])
    assert rb.tokens_per_step == 24 * SEQ


def test_different_steps_and_seeds_read_different_rows(batch_ds):
    rb = rank_batches(batch_ds, 0, 1)
    assert not torch.equal(rb.rank_rows(0), rb.rank_rows(1))
    assert not torch.equal(rb.rank_rows(0), rank_batches(batch_ds, 0, 1, seed=4).rank_rows(0))
    assert torch.equal(rb.rank_rows(7), rank_batches(batch_ds, 0, 1).rank_rows(7))


def test_microbatches_advance_next_step_and_state_round_trips(batch_ds):
    rb = rank_batches(batch_ds, 1, 2)
    assert rb.next_step == 0
    rb.microbatches(0)
    assert rb.next_step == 1
    rb.microbatches(9)
    assert rb.next_step == 10
    state = rb.state_dict()
    assert state["next_step"] == 10 and state["dataset"] == batch_ds.fingerprint

    resumed = rank_batches(batch_ds, 1, 2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a trip through JSON
    assert resumed.next_step == 10
    assert resumed.state_dict() == state
    for b0, b1 in zip(rb.microbatches(10), resumed.microbatches(10)):
        assert torch.equal(b0.tokens, b1.tokens) and torch.equal(b0.targets, b1.targets)


def test_state_of_another_dataset_is_refused(batch_ds, other_ds):
    assert batch_ds.fingerprint != other_ds.fingerprint
    state = rank_batches(batch_ds, 0, 1).state_dict()
    elsewhere = rank_batches(other_ds, 0, 1)
    with pytest.raises(ValueError, match="saved with dataset="):
        elsewhere.load_state_dict(state)
    assert elsewhere.next_step == 0


@pytest.mark.parametrize("key, value", [("seed", 99), ("global_batch", 48)])
def test_state_of_another_seed_or_batch_is_refused(batch_ds, key, value):
    state = {**rank_batches(batch_ds, 0, 1).state_dict(), key: value}
    with pytest.raises(ValueError, match=f"saved with {key}="):
        rank_batches(batch_ds, 0, 1).load_state_dict(state)


@pytest.mark.parametrize("global_batch,micro,dp", [(24, 5, 1), (24, 2, 5), (10, 3, 2), (8, 16, 1), (6, 1, 4)])
def test_global_batch_not_divisible_by_micro_times_dp_raises(batch_ds, global_batch, micro, dp):
    with pytest.raises(ValueError, match="not divisible"):
        RankBatches(batch_ds, seed=0, global_batch=global_batch, micro_batch=micro, seq_len=SEQ, dp_rank=0, dp_size=dp)


# --------------------------------------------------------------------------- default corpus

STDLIB = {
    "abc_.py": "class A:\n    pass\n",
    "json_/__init__.py": "from .decoder import *\n",
    "json_/decoder.py": "def decode(s):\n    return s  # “quotes”\n",
    "site-packages/thirdparty/mod.py": "THIRD = 'party'\n",
    "dist-packages/other.py": "OTHER = 1\n",
    "README.txt": "not python\n",
}
STDLIB_KEPT = ("abc_.py", "json_/__init__.py", "json_/decoder.py")


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    src = write_tree(tmp_path / "stdlib", STDLIB)
    monkeypatch.setattr(corpus, "stdlib_dir", lambda: src)
    return src


def preparing_dirs(cache: Path) -> list[Path]:
    return list(cache.glob(".preparing-*"))


def test_default_corpus_is_prepared_once_and_cached(tmp_path, fake_stdlib, monkeypatch):
    cache = tmp_path / "cache"
    path = ensure_default_corpus(str(cache))
    v = sys.version_info
    assert Path(path) == cache / f"pystdlib-{v.major}.{v.minor}"
    meta = read_meta(path)
    assert meta["num_documents"] == len(STDLIB_KEPT)  # no site-packages, no dist-packages, no .txt
    ds = TokenDataset(path)
    np.testing.assert_array_equal(ds.window(0, ds.num_tokens), expected_tokens({k: STDLIB[k] for k in STDLIB_KEPT}))
    assert preparing_dirs(cache) == []

    mtime = os.stat(Path(path, "meta.json")).st_mtime_ns
    listing = sorted(p.name for p in Path(path).iterdir())

    def must_not_prepare():
        raise AssertionError("the cached corpus was prepared again")

    monkeypatch.setattr(corpus, "stdlib_dir", must_not_prepare)
    assert ensure_default_corpus(str(cache)) == path
    assert os.stat(Path(path, "meta.json")).st_mtime_ns == mtime
    assert sorted(p.name for p in Path(path).iterdir()) == listing
    assert preparing_dirs(cache) == []


def test_failed_default_corpus_leaves_nothing_behind(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(corpus, "stdlib_dir", lambda: empty)
    cache = tmp_path / "cache"
    with pytest.raises(DataError):
        ensure_default_corpus(str(cache))
    assert list(cache.iterdir()) == []


def test_default_corpus_race_lost_to_another_preparer_uses_the_winner(tmp_path, fake_stdlib, monkeypatch):
    cache = tmp_path / "cache"
    v = sys.version_info
    target = cache / f"pystdlib-{v.major}.{v.minor}"
    real_prepare = corpus.prepare

    def prepare_while_another_process_wins(src, out, **kw):
        real_prepare(src, str(target), **kw)  # the other preparer commits first
        return real_prepare(src, out, **kw)

    monkeypatch.setattr(corpus, "prepare", prepare_while_another_process_wins)
    assert ensure_default_corpus(str(cache)) == str(target)
    assert read_meta(str(target))["num_documents"] == len(STDLIB_KEPT)
    assert preparing_dirs(cache) == []
    assert sorted(p.name for p in cache.iterdir()) == [target.name]


def test_prefetched_rows_are_the_rows_of_the_step_asked_for(batch_ds):
    """The reader prefetches step k+1; asking for any other step still gets that step's rows."""
    fresh = rank_batches(batch_ds, 1, 2)
    ahead = rank_batches(batch_ds, 1, 2)
    for step in (0, 1, 2, 7, 3, 3, 4):
        got = ahead.microbatches(step)
        want = fresh.rank_rows(step)
        assert torch.equal(torch.cat([b.tokens for b in got]), want[:, :-1])
        assert torch.equal(torch.cat([b.targets for b in got]), want[:, 1:])
        assert ahead.next_step == step + 1


def test_columns_are_read_as_pyarrow_reads_them_without_importing_pandas(prepared):
    """`numbers` views a column's Arrow buffers: what `to_numpy()` gives, for a sliced array and
    a column of several chunks, and a fresh process reading a window never imports pandas
    (`to_numpy`'s first call does: 0.23 s on every rank's first step)."""
    import pyarrow as pa

    from rayzero.data.tokens import numbers

    values = pa.array(np.arange(1000, dtype=np.uint16))
    for column in (pa.chunked_array([values]), pa.chunked_array([values.slice(7, 300), values.slice(500, 11)]),
                   pa.chunked_array([values.slice(3, 0)])):
        assert np.array_equal(numbers(column), column.to_numpy()) and numbers(column).dtype == np.uint16
    with pytest.raises(DataError, match="shard-0.parquet, tokens: expected integers without nulls, got int32 with 1 nulls"):
        numbers(pa.chunked_array([pa.array([1, None], type=pa.int32())]), "shard-0.parquet, tokens")
    out, _, expected = prepared
    probe = (f"import sys; from rayzero.data.tokens import TokenDataset; "
             f"w = TokenDataset({out!r}).window(0, 50); "
             f"assert 'pandas' not in sys.modules, 'pandas imported'; print(w.sum())")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout) == int(expected[:50].sum())
