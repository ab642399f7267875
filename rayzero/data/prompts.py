"""Prompts for online RL, made from records when data is prepared (`rayzero data prepare SRC OUT
--prompts`), in TRL's prompt-only formats:

    standard         {"prompt": "What is 2 + 3?", ...}
    conversational   {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], ...}

A standard prompt is tokenized as TRL's `GRPOTrainer` tokenizes it (the tokenizer's own call, its
special tokens included); a conversational one is rendered by the chat template with the
generation prompt. Each prompt is one document of the dataset's shards; every other field of the
record is kept, in `columns.parquet` (one row a prompt, in order, beside the prompt as the record
gave it), for the reward functions, which receive them as keyword arguments. A record without a
prompt is refused, naming it; one dataset holds one format.
"""

from __future__ import annotations

import io
import json
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayzero.data.errors import DataError
from rayzero.data.sources import SourceFile, json_records
from rayzero.data.tokenizer import HFTokenizer, Tokenizer

COLUMNS = "columns.parquet"  # the records' other fields, one row a prompt


def prompt_records(f: SourceFile, skipped: list[str] | None) -> Iterator[tuple[str, dict]]:
    """(where, record) of each prompt record of `f`: JSON lines, or every column of a Parquet file."""
    if f.format == "json":
        yield from json_records(f, skipped)
        return
    if f.format != "parquet":
        raise DataError(f"{f.uri}: prompt data is JSON lines (.jsonl) or Parquet of records with a `prompt`")
    with f.fs.open_input_file(f.path) as handle:
        table = pq.read_table(handle)
    if "prompt" not in table.column_names:
        raise DataError(f"{f.uri}: no column 'prompt' (it has: {', '.join(table.column_names)})")
    for row, rec in enumerate(table.to_pylist(), 1):
        yield f"{f.uri}#{row}", {k: v for k, v in rec.items() if v is not None}


def is_conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def prompt_ids(tok: Tokenizer, rec, where: str) -> tuple[np.ndarray, bool]:
    """(the prompt's token ids, whether it is conversational), refused in one line naming
    `where` when the record has no prompt TRL would read."""
    if not isinstance(rec, dict) or "prompt" not in rec:
        keys = ", ".join(map(repr, rec)) if isinstance(rec, dict) else type(rec).__name__
        raise DataError(f"{where}: no `prompt` (it has {keys}); a prompt record is {{\"prompt\": \"...\"}} or "
                        "{\"prompt\": [{\"role\": \"user\", \"content\": \"...\"}]}")
    prompt = rec["prompt"]
    if is_conversational(prompt):
        if not isinstance(tok, HFTokenizer) or not tok.chat_template:
            raise DataError(f"{where}: a conversational prompt needs a tokenizer with a chat template (this one has "
                            "none); give a string, or a tokenizer with `chat_template`")
        try:
            out = tok.tok.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True,
                                              tools=None)
        except Exception as e:  # noqa: BLE001 (the template's own error, e.g. a role it refuses)
            raise DataError(f"{where}: the chat template does not render it ({str(e).strip().splitlines()[0]})") \
                from None
        ids = np.asarray(out["input_ids"], np.int64)
        conversational = True
    elif isinstance(prompt, str) and prompt:
        ids = np.asarray(tok.tok(prompt)["input_ids"] if isinstance(tok, HFTokenizer) else tok.encode_batch([prompt])[0],
                         np.int64)
        conversational = False
    else:
        raise DataError(f"{where}: `prompt` is {'empty' if prompt == '' else type(prompt).__name__}; it must be a "
                        "string or a list of {role, content} messages")
    if ids.size == 0:
        raise DataError(f"{where}: the prompt tokenizes to nothing")
    return ids, conversational


class PromptColumns:
    """The records' fields beside each prompt, kept in order for `columns.parquet`; one format a dataset."""

    def __init__(self):
        self.rows: list[dict] = []
        self.first: tuple[bool, str] | None = None

    def add(self, rec: dict, conversational: bool, where: str) -> None:
        if self.first is None:
            self.first = (conversational, where)
        elif self.first[0] != conversational:
            said = ("conversational" if conversational else "standard", self.first[1],
                    "conversational" if self.first[0] else "standard")
            raise DataError(f"{where}: mixed formats: this prompt is {said[0]}, {said[1]} is {said[2]}; one dataset "
                            "holds prompts of one format")
        row = {k: v for k, v in rec.items() if k != "prompt"}
        # the prompt as given (messages as JSON): what the reward functions receive as `prompts`
        row["prompt"] = json.dumps(rec["prompt"]) if conversational else rec["prompt"]
        self.rows.append(row)

    def parquet(self) -> bytes:
        try:
            table = pa.Table.from_pylist(self.rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise DataError(f"the prompt records' other fields do not make one table: {e}") from None
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        return buf.getvalue()


def add_prompts(files, tok, writer, skipped, bar) -> PromptColumns:
    """Each prompt record of `files` into `writer` (a `ShardWriter`) as one document; its other
    fields kept, in order (`PromptColumns`, written beside the shards as COLUMNS)."""
    columns = PromptColumns()
    for f in files:
        for where, rec in prompt_records(f, skipped):
            ids, conversational = prompt_ids(tok, rec, where)
            columns.add(rec, conversational, where)
            writer.add(ids)
        bar.update(f.size)
    return columns


def prompt_tokens(dataset) -> list[np.ndarray]:
    """Each prompt's token ids, in order, from a prepared prompts dataset (`TokenDataset`)."""
    ends = np.cumsum(dataset.document_lengths)
    return [dataset.window(int(start), int(end - start)) for start, end in zip(np.r_[0, ends[:-1]], ends)]


def read_prompts(dataset) -> list[dict]:
    """Each prompt's record as prepared (its `prompt` as given, messages decoded, and every
    other field), in order: from a prepared prompts dataset (`TokenDataset`)."""
    with dataset._open(COLUMNS) as f:
        rows = pq.read_table(f).to_pylist()
    conversational = dataset.meta.get("conversational", False)
    return [{**r, "prompt": json.loads(r["prompt"]) if conversational else r["prompt"]} for r in rows]
