"""Prompts for online RL (`rayzero data prepare SRC OUT --prompts`): TRL's prompt-only records,
standard and conversational, tokenized as TRL's `GRPOTrainer._tokenize_prompts` tokenizes them
(its own code, run here), every other field kept in order for the rewards; a record without a
prompt refused naming it, one format a dataset, and a prompts dataset refused by an objective
that does not read prompts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("trl")

from rayzero.data.errors import DataError  # noqa: E402
from rayzero.data.prompts import prompt_tokens, read_prompts  # noqa: E402
from rayzero.data.tokens import TokenDataset, prepare  # noqa: E402
from tests.conftest import cli_in_process  # noqa: E402
from tests.unit.test_preferences import chat_tok, text_tok, user, write_jsonl  # noqa: E402,F401

STANDARD = [{"prompt": "What is 2 + 3?", "answer": "5", "level": 1},
            {"prompt": "Reverse 'abc'.", "answer": "cba", "level": 2}]
CONVERSATIONAL = [{"prompt": [user("What is 2 + 3?")], "answer": "5"},
                  {"prompt": [{"role": "system", "content": "Be brief."}, user("Reverse 'abc'.")], "answer": "cba"}]


def trl_prompt_ids(tok_dir: str, prompts: list) -> list[list[int]]:
    import transformers as tf
    from trl.trainer.grpo_trainer import GRPOTrainer

    this = SimpleNamespace(processing_class=tf.AutoTokenizer.from_pretrained(tok_dir), _is_vlm=False,
                           environment_factories=None, tools=None, chat_template=None, chat_template_kwargs={})
    ids, _, _ = GRPOTrainer._tokenize_prompts(this, prompts)
    return [list(i) for i in ids]


def prepared_ids(out: str) -> list[list[int]]:
    return [t.tolist() for t in prompt_tokens(TokenDataset(out))]


@pytest.mark.parametrize("records,tok", [(STANDARD, "text_tok"), (CONVERSATIONAL, "chat_tok")])
def test_prompts_are_tokenized_as_trl_and_keep_their_fields(records, tok, tmp_path, request):
    tok = request.getfixturevalue(tok)
    meta = prepare(write_jsonl(tmp_path / "p.jsonl", records), str(tmp_path / "out"), tokenizer=tok, prompts=True)
    assert meta["kind"] == "prompts" and meta["num_prompts"] == 2
    assert prepared_ids(str(tmp_path / "out")) == trl_prompt_ids(tok, [r["prompt"] for r in records])
    assert read_prompts(TokenDataset(str(tmp_path / "out"))) == records  # every field, in order, the prompt as given


def test_parquet_prompts_keep_every_column(text_tok, tmp_path):
    pq.write_table(pa.Table.from_pylist(STANDARD), tmp_path / "p.parquet")
    meta = prepare(tmp_path / "p.parquet", str(tmp_path / "out"), tokenizer=text_tok, prompts=True)
    assert meta["columns"] == ["answer", "level"]
    assert read_prompts(TokenDataset(str(tmp_path / "out"))) == STANDARD


@pytest.mark.parametrize("records,said", [
    ([STANDARD[0], {"question": "x"}], r"p\.jsonl:2: no `prompt` \(it has 'question'\)"),
    ([{"prompt": ""}], r"p\.jsonl:1: `prompt` is empty"),
    ([STANDARD[0], CONVERSATIONAL[0]], r"p\.jsonl:2: mixed formats: this prompt is conversational"),
])
def test_a_bad_record_is_refused_naming_it(records, said, chat_tok, tmp_path):
    with pytest.raises(DataError, match=said):
        prepare(write_jsonl(tmp_path / "p.jsonl", records), str(tmp_path / "out"), tokenizer=chat_tok, prompts=True)
    assert not (tmp_path / "out").exists(), "a failed prepare leaves nothing behind"


def test_the_command_prepares_prompts_and_training_next_token_on_them_is_refused(text_tok, tmp_path, capsys,
                                                                                monkeypatch):
    write_jsonl(tmp_path / "p.jsonl", STANDARD)
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "p.jsonl", "prompts",
                                    "--tokenizer", text_tok, "--prompts", "--no-progress")
    assert code == 0, err
    assert "from 2 prompts (their other fields: answer, level)" in out
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", "data.path=prompts")
    assert code == 2
    assert "train.objective=lm learns from text or instruction examples, but data.path: " in err
    assert "holds prompts for online RL (prepared with --prompts)" in err
    assert json.loads((tmp_path / "prompts" / "meta.json").read_text())["kind"] == "prompts"
