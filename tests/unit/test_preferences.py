"""Preference data (`rayzero data prepare --preferences`, `train.objective=dpo`) against TRL's
DPOTrainer itself: the pairs a real DPOTrainer tokenizes (its `train_dataset`) and the rows its
DataCollatorForPreference makes of them are the reference. rayzero does not import trl; this
test does."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("trl")

from rayzero.config import load_config  # noqa: E402
from rayzero.data.errors import DataError  # noqa: E402
from rayzero.data.instruct import IGNORE_INDEX  # noqa: E402
from rayzero.data.preferences import EMPTY, PairEpochs, Pairs, PreferenceBatches, pair_counts  # noqa: E402
from rayzero.data.tokens import TokenDataset, prepare, read_meta  # noqa: E402
from rayzero.data.validation import ValidationRows, split  # noqa: E402
from tests.conftest import cli_in_process  # noqa: E402
from tests.models import CHAT_SPECIAL, CHATML, save_tokenizer  # noqa: E402

TEXTS = ["What color is the sky? It is blue. It is green. The quick brown fox jumps over the lazy dog.",
         "Question: why not? Answer: because. the queen quickly quit", "def add(a, b):\n    return a + b\n"] * 20

STANDARD = [
    {"prompt": "What color is the sky?", "chosen": " It is blue.", "rejected": " It is green."},
    {"prompt": "the qu", "chosen": "ick brown fox", "rejected": "een"},  # tokens merge across the boundary
    {"prompt": "Question: why not?", "chosen": " Answer: because.</s>", "rejected": " no"},  # ends with EOS already
    {"prompt": "def add(a, b):\n", "chosen": "    return a + b\n", "rejected": "    return a - b\n"},
] + [{"prompt": "Question: " + "why " * i, "chosen": " Answer: " + "because " * (i % 5 + 1),
      "rejected": " the lazy dog" * (i % 3 + 1)} for i in range(1, 13)]
IMPLICIT = [
    {"chosen": "Question: sky? Answer: blue", "rejected": "Question: sky? Answer: green"},
    {"chosen": "the quick fox", "rejected": "the quick fox jumps"},  # one begins the other
    {"chosen": "What color? It is blue.", "rejected": "What color? green"},
]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


CONVERSATIONAL = [
    {"prompt": [user("What color is the sky?")], "chosen": [assistant("It is blue.")],
     "rejected": [assistant("It is green.")]},
    {"prompt": [{"role": "system", "content": "be brief"}, user("why?"), assistant("because."), user("why not?")],
     "chosen": [assistant("the lazy dog")], "rejected": [assistant("no")]},
]
CONVERSATIONAL_IMPLICIT = [
    {"chosen": [user("What color is the sky?"), assistant("It is blue.")],
     "rejected": [user("What color is the sky?"), assistant("It is green.")]},
    {"chosen": [user("why?"), assistant("because. the quick brown fox")], "rejected": [user("why?"), assistant("no")]},
]


@pytest.fixture(scope="module")
def text_tok(tmp_path_factory) -> str:
    """A byte-level BPE that adds BOS to every text (as Llama's does), EOS `</s>`."""
    import transformers as tf

    d = tmp_path_factory.mktemp("bpe")
    save_tokenizer(d, TEXTS, vocab=320)
    tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tok.add_bos_token = True
    tok.save_pretrained(str(d / "hf"))
    return str(d / "hf")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory) -> str:
    """ChatML's template and special tokens, EOS `<|im_end|>`."""
    d = tmp_path_factory.mktemp("chat")
    save_tokenizer(d, TEXTS, vocab=340, special=CHAT_SPECIAL, every_byte=True)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    return str(d)


def trl_pairs(tok_dir: str, records: list[dict], max_length: int, out: Path) -> list[dict]:
    """What a DPOTrainer of trl makes of `records`: its train_dataset's prompt/chosen/rejected ids
    (pairs whose prompt fills `max_length` dropped)."""
    import transformers as tf
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    args = DPOConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to=[], max_length=max_length)
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                         train_dataset=Dataset.from_list(records), processing_class=tok)
    return [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in trainer.train_dataset]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepared(tmp_path: Path, tok: str, records: list[dict], name: str = "prefs") -> TokenDataset:
    src = write_jsonl(tmp_path / f"{name}.jsonl", records)
    prepare(src, str(tmp_path / name), tokenizer=tok, preferences=True, row_group_tokens=64)
    return TokenDataset(str(tmp_path / name))


def our_pairs(ds: TokenDataset) -> list[dict]:
    """The dataset's pairs as TRL's fields: the prompt is where the mask turns on."""
    lengths, prompts = ds.document_lengths, ds.prompt_lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = []
    for p in range(lengths.size // 2):
        (c, cm), (r, rm) = (ds.window_with_mask(int(offsets[i]), int(lengths[i])) for i in (2 * p, 2 * p + 1))
        n = int(prompts[2 * p])
        assert prompts[2 * p + 1] == n and c[:n].tolist() == r[:n].tolist()
        assert cm.tolist() == [0] * n + [1] * (c.size - n) and rm.tolist() == [0] * n + [1] * (r.size - n)
        out.append({"prompt_ids": c[:n].tolist(), "chosen_ids": c[n:].tolist(), "rejected_ids": r[n:].tolist()})
    return out


# --------------------------------------------------------------------------- tokenized as TRL does

@pytest.mark.parametrize("fmt", ["standard", "implicit", "conversational", "conversational-implicit"])
def test_pairs_are_tokenized_as_trls_dpo_trainer_tokenizes_them(tmp_path, text_tok, chat_tok, fmt):
    records, tok = {"standard": (STANDARD, text_tok), "implicit": (IMPLICIT, text_tok),
                    "conversational": (CONVERSATIONAL, chat_tok),
                    "conversational-implicit": (CONVERSATIONAL_IMPLICIT, chat_tok)}[fmt]
    ds = prepared(tmp_path, tok, records)
    meta = read_meta(ds.uri)
    assert meta["kind"] == "preferences" and meta["num_pairs"] == len(records)
    assert meta["num_documents"] == 2 * len(records) and (Path(ds.uri) / "tokenizer").is_dir()
    ours = our_pairs(ds)
    assert ours == trl_pairs(tok, records, 4096, tmp_path / "trl")
    assert meta["num_target_tokens"] == sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in ours)
    if fmt == "standard":  # the BOS the tokenizer adds, and a boundary where tokens merge
        import transformers as tf

        assert all(p["prompt_ids"][0] == 0 for p in ours)
        alone = tf.AutoTokenizer.from_pretrained(tok)("the qu")["input_ids"]
        assert ours[1]["prompt_ids"] == alone[: len(ours[1]["prompt_ids"])] != alone  # "qu" merged into "quick"


def test_parquet_records_make_the_same_pairs(tmp_path, text_tok):
    pq.write_table(pa.Table.from_pylist(STANDARD[:4]), tmp_path / "prefs.parquet")
    prepare(tmp_path / "prefs.parquet", str(tmp_path / "pq"), tokenizer=text_tok, preferences=True)
    assert our_pairs(TokenDataset(str(tmp_path / "pq"))) == our_pairs(prepared(tmp_path, text_tok, STANDARD[:4]))


# --------------------------------------------------------------------------- training rows

SEQ_LEN = 11  # max_length 12: some pairs cut, some dropped


def trl_rows(pairs: list[dict], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's collator rows for `pairs` at max_length SEQ_LEN + 1, in rayzero's order (chosen and
    rejected of a pair side by side), padded to SEQ_LEN + 1: (input_ids, completion_mask)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    out = DataCollatorForPreference(pad_token_id=pad, max_length=SEQ_LEN + 1)(pairs)
    n = len(pairs)
    order = [j for i in range(n) for j in (i, n + i)]
    ids, mask = out["input_ids"][order], out["completion_mask"][order]
    width = SEQ_LEN + 1 - ids.shape[1]
    return (torch.nn.functional.pad(ids, (0, width), value=pad), torch.nn.functional.pad(mask, (0, width)))


def test_rows_are_trls_collated_rows_cut_at_seq_len_plus_one(tmp_path, text_tok):
    ds = prepared(tmp_path, text_tok, STANDARD)
    reference = trl_pairs(text_tok, STANDARD, SEQ_LEN + 1, tmp_path / "trl")  # TRL drops the long prompts
    counts = pair_counts(ds, SEQ_LEN)
    assert counts.kept == len(reference) and 0 < counts.dropped < counts.pairs
    assert counts.truncated == sum(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))
                                   > SEQ_LEN + 1 for r in reference) > 0
    pad = int(ds.meta["eot"])
    b = PreferenceBatches(ds, seed=5, global_batch=2 * 8, micro_batch=4, seq_len=SEQ_LEN, dp_rank=0, dp_size=1)
    assert b.masks_labels and b.pairs and b.counts == counts
    for step in range(b.epochs.steps_in(0)):
        tokens, labels = b.rank_rows(step)
        picked = b.epochs.step_pairs(step)
        real = [int(k) for k in picked if k != EMPTY]
        ids, mask = trl_rows([reference[k] for k in real], pad)
        assert torch.equal(tokens[: 2 * len(real)], ids)
        want = torch.where(mask.bool(), ids, IGNORE_INDEX)
        want[:, 0] = IGNORE_INDEX
        assert torch.equal(labels[: 2 * len(real)], want)
        assert (tokens[2 * len(real):] == pad).all() and (labels[2 * len(real):] == IGNORE_INDEX).all()
        micro = b._split((tokens, labels))
        assert len(micro) == 4 and all(m.tokens.shape == m.targets.shape == (4, SEQ_LEN) for m in micro)
        assert all(m.documents is None for m in micro)  # one sequence a row, its padding after it
        assert torch.equal(torch.cat([m.tokens for m in micro]), tokens[:, :-1])
        assert torch.equal(torch.cat([m.targets for m in micro]), labels[:, 1:])


def test_the_same_step_holds_the_same_pairs_at_any_world_size(tmp_path, text_tok):
    ds = prepared(tmp_path, text_tok, STANDARD)
    kw = dict(seed=1, global_batch=8, seq_len=SEQ_LEN)
    whole = PreferenceBatches(ds, micro_batch=4, dp_rank=0, dp_size=1, **kw)
    for step in range(4):
        one = whole.microbatches(step)
        parts = [PreferenceBatches(ds, micro_batch=2, dp_rank=r, dp_size=2, **kw).microbatches(step) for r in range(2)]
        for field in ("tokens", "targets"):
            assert torch.equal(torch.cat([getattr(m, field) for m in one]),
                               torch.cat([getattr(m, field) for p in parts for m in p]))
    state = whole.state_dict()
    assert state["next_step"] == 4 and state["seq_len"] == SEQ_LEN
    other = PreferenceBatches(ds, micro_batch=2, dp_rank=0, dp_size=2, **{**kw, "seq_len": 20})
    with pytest.raises(ValueError, match="seq_len=11"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="both must be even"):
        PreferenceBatches(ds, micro_batch=3, dp_rank=0, dp_size=1, **{**kw, "global_batch": 9})


def test_each_epoch_sees_every_pair_once():
    ep = PairEpochs(7, seed=3, pairs_per_step=3)
    assert ep.steps_in(0) == 3 and ep.steps(2) == 6 and ep.locate(4) == (1, 1)
    for epoch in (0, 1):
        seen = np.concatenate([ep.step_pairs(3 * epoch + k) for k in range(3)])
        assert sorted(seen[seen != EMPTY].tolist()) == list(range(7)) and (seen == EMPTY).sum() == 2
        assert (ep.step_pairs(3 * epoch + 2)[1:] == EMPTY).all()  # the last step is filled up
    assert not np.array_equal(ep.order(0), ep.order(1))


def test_data_epochs_count_steps_of_pairs(tmp_path, text_tok):
    from rayzero.jobs.train import steps_in_epochs

    data = prepared(tmp_path, text_tok, STANDARD).uri
    cfg = load_config(None, [f"train.seq_len={SEQ_LEN}", "train.global_batch_size=4", "train.micro_batch_size=2",
                             "data.epochs=2", f"data.path={data}"])
    kept = pair_counts(TokenDataset(data), SEQ_LEN).kept
    assert steps_in_epochs(cfg, data) == 2 * -(-kept // 2)


# --------------------------------------------------------------------------- validation

def test_val_fraction_holds_out_whole_pairs(tmp_path, text_tok):
    ds = prepared(tmp_path, text_tok, STANDARD)
    pairs = our_pairs(ds)
    train, val = split(ds, 0.2)  # 3 of the 16 pairs
    assert val.document_lengths.size == 2 * 3 and train.document_lengths.size == 2 * 13
    held = our_pairs(val) + our_pairs(train)  # Subsets read like datasets: every pair still whole
    assert sorted(map(json.dumps, held)) == sorted(map(json.dumps, pairs))
    with pytest.raises(DataError, match="of the 16 pairs"):
        split(ds, 0.01)
    rows = {}
    for d in (1, 2):
        parts = [ValidationRows(val, seq_len=40, global_batch=4, micro_batch=4 // d, dp_rank=r, dp_size=d,
                                max_batches=5) for r in range(d)]
        assert parts[0].pairs and parts[0].num_rows == 3 and parts[0].num_batches == 2  # 2 pairs a batch
        rows[d] = [torch.cat([torch.cat([m.targets for m in p.microbatches(b)]) for p in parts]) for b in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(rows[1], rows[2]))
    assert (rows[1][1][2:] == IGNORE_INDEX).all() and (rows[1][1][:2] != IGNORE_INDEX).any()  # 1 pair, 1 padding
    first = Pairs(val, 40).rows([0])
    assert torch.equal(rows[1][0][:2], torch.from_numpy(first[1])[:, 1:])


# --------------------------------------------------------------------------- the driver's checks

def test_the_objective_and_the_data_must_agree(tmp_path, text_tok):
    from rayzero.jobs.train import check_objective, note_pairs

    prefs = prepared(tmp_path, text_tok, STANDARD)
    write_jsonl(tmp_path / "docs.jsonl", [{"text": "the quick brown fox"}])
    text = prepare(tmp_path / "docs.jsonl", str(tmp_path / "text"))
    with pytest.raises(DataError, match=r"train\.objective=dpo .* but data\.path: .*text holds text .*--preferences"):
        check_objective("dpo", "data.path", str(tmp_path / "text"), text)
    with pytest.raises(DataError, match=r"data\.val_path: .* holds preference pairs .* set train\.objective=dpo"):
        check_objective("lm", "data.val_path", prefs.uri, prefs.meta)
    check_objective("dpo", "data.path", prefs.uri, prefs.meta)
    check_objective("lm", "data.path", str(tmp_path / "text"), text)
    long = prepared(tmp_path, text_tok, STANDARD[4:], "long")  # prompts of BOS, "Question", ":" and more
    cfg = load_config(None, ["train.seq_len=2", f"data.path={long.uri}"])
    with pytest.raises(DataError, match="the prompt of every one of its 12 pairs fills train.seq_len"):
        note_pairs(cfg, long)
    note_pairs(cfg.override(f"train.seq_len={SEQ_LEN}"), long)


def test_the_cli_prepares_pairs(tmp_path, capsys, monkeypatch, text_tok):
    write_jsonl(tmp_path / "p.jsonl", STANDARD[:3])
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "p.jsonl", "out",
                                    "--tokenizer", text_tok, "--preferences", "--no-progress")
    assert code == 0 and "from 3 pairs (6 sequences)" in out
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "p.jsonl", "out",
                                  "--preferences", "--instructions")
    assert code == 2 and "not allowed with" in err


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("records, message", [
    ([{"prompt": "a", "rejected": "b"}], r"prefs\.jsonl:1: .*`chosen` is missing"),
    ([STANDARD[0], {"prompt": "a", "chosen": "b"}], r"prefs\.jsonl:2: .*`rejected` is missing"),
    ([{"prompt": "a", "chosen": "", "rejected": "b"}], r"prefs\.jsonl:1: `chosen` is empty"),
    ([{"prompt": [user("a")], "chosen": [assistant("b")], "rejected": []}], r":1: `rejected` is empty"),
    ([{"prompt": "a", "chosen": [assistant("b")], "rejected": [assistant("c")]}], r":1: mixed types"),
    ([STANDARD[0], CONVERSATIONAL[0]], r"prefs\.jsonl:2: mixed types: this record is conversational"),
    ([STANDARD[0], IMPLICIT[0]], r"prefs\.jsonl:2: mixed types: .*prompt implicit"),
    ([{"chosen": "yes", "rejected": "no"}], r":1: `chosen` and `rejected` do not begin alike"),
    ([{"prompt": "a", "chosen": 3, "rejected": "b"}], r":1: `chosen` is int, not a string or a list of messages"),
    ([{"prompt": "a", "response": "b"}], r"`chosen` is missing .*prepare them with --instructions"),
])
def test_bad_records_are_named_by_file_and_line(tmp_path, chat_tok, records, message):
    with pytest.raises(DataError, match=message):
        prepared(tmp_path, chat_tok, records)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs.jsonl"], "a failed prepare leaves nothing behind"


def test_a_failed_prepare_leaves_nothing_and_a_dataset_there_as_it_was(tmp_path, capsys, monkeypatch, text_tok):
    """The shards go to a hidden folder beside the output, renamed at the commit: a failure
    leaves neither an empty folder that training would take for a missing dataset, nor a dataset
    already there half replaced."""
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "rejected": "b"}])
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "bad.jsonl", "out",
                                  "--tokenizer", text_tok, "--preferences", "--no-progress")
    assert code == 2 and "`chosen` is missing" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"], "nothing left behind"
    # training on the path it never made: the hint is the command that makes pairs
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "train.objective=dpo", "data.path=out")
    assert code == 2 and f"rayzero data prepare SRC {tmp_path / 'out'} --preferences`" in err, err

    good = prepared(tmp_path, text_tok, STANDARD[:3], "out")
    before = {p.name: p.read_bytes() for p in Path(good.uri).rglob("*") if p.is_file()}
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "bad.jsonl", "out",
                                  "--tokenizer", text_tok, "--preferences", "--no-progress")
    assert code == 2
    assert {p.name: p.read_bytes() for p in Path(good.uri).rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out", "out.jsonl"]
    prepared(tmp_path, text_tok, STANDARD[3:6], "out")  # prepared again over it: replaced at the commit
    assert TokenDataset(str(tmp_path / "out")).meta["num_pairs"] == 3


def test_pairs_prepared_as_something_else_get_a_hint(tmp_path, chat_tok):
    src = write_jsonl(tmp_path / "p.jsonl", STANDARD[:2])
    with pytest.raises(DataError, match=r"p\.jsonl:1: no field 'text' .*prepare them with --preferences"):
        prepare(src, str(tmp_path / "a"))
    with pytest.raises(DataError, match=r"p\.jsonl:1: an instruction record .*prepare them with --preferences"):
        prepare(src, str(tmp_path / "b"), instructions=True)
    with pytest.raises(DataError, match="need a tokenizer with a chat template"):
        prepared(tmp_path, "byte", CONVERSATIONAL)
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "chosen": "b"}]), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet: no column 'rejected'"):
        prepare(tmp_path / "p.parquet", str(tmp_path / "c"), preferences=True)
