"""Preference pairs, made from records when data is prepared (`rayzero data prepare SRC OUT
--preferences`) and tokenized as TRL's DPOTrainer tokenizes them (trl 1.16, `_prepare_dataset`);
what training reads of them is `preferences`'.

A record (a JSON line, or a Parquet row with these columns) is in one of TRL's formats:

    {"prompt": str, "chosen": str, "rejected": str}           standard
    {"prompt": [msg, ...], "chosen": [...], "rejected": [...]}  conversational: {"role", "content"}
                                                                messages, rendered with the chat template
    {"chosen": ..., "rejected": ...}                            implicit prompt (either of the above)

An implicit prompt is the longest common beginning of chosen and rejected (TRL's
`extract_prompt`: of the strings, or of the message lists). Standard completions end with the
tokenizer's EOS token, added as text where they do not; the prompt, prompt + chosen and
prompt + rejected are each encoded by the tokenizer's own call (with its BOS where it adds
one), or rendered by its chat template (the prompt alone with the generation prompt). The
prompt is as long as the shortest common beginning of its ids and those of prompt + chosen or
prompt + rejected: the completions start where the ids diverge (TRL's `common_prefix_length`).

A pair is stored as two consecutive examples, prompt + chosen then prompt + rejected, with a
mask of 1 on the completion's tokens. One dataset holds one format, that of its first record
(which is what TRL goes by).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from rayzero.data.errors import DataError
from rayzero.data.sources import SourceFile, json_records, parquet_records
from rayzero.data.tokenizer import HFTokenizer, Tokenizer

FIELDS = ("prompt", "chosen", "rejected")
COMPLETIONS = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One record's two sequences, the prompt's ids at the start of both."""

    prompt: int  # tokens of prompt, the same in both
    chosen: np.ndarray  # prompt + chosen ids
    rejected: np.ndarray
    form: str  # the record's format, in words

    def examples(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of prompt + chosen, then of prompt + rejected."""
        out = []
        for ids in (self.chosen, self.rejected):
            mask = np.zeros(ids.size, np.uint8)
            mask[self.prompt:] = 1
            out.append((ids, mask))
        return out


def pair_records(f: SourceFile, skipped: list[str] | None) -> Iterator[tuple[str, dict]]:
    """(where, record) of each preference record in a JSON lines or Parquet file."""
    if f.format == "json":
        return json_records(f, skipped)
    if f.format == "parquet":
        return parquet_records(f, FIELDS, required=COMPLETIONS)
    raise DataError(f"{f.uri}: preference data is JSON lines (.jsonl) or Parquet of prompt/chosen/rejected records")


def common_prefix_length(ids: np.ndarray, other: np.ndarray) -> int:
    """How many leading ids the two have in common."""
    n = min(ids.size, other.size)
    differ = np.flatnonzero(ids[:n] != other[:n])
    return int(differ[0]) if differ.size else n


def extract_prompt(chosen, rejected, where: str) -> tuple:
    """(prompt, chosen, rejected) of an implicit-prompt record, as TRL's `extract_prompt` splits
    it: at the first element (character or message) where they differ, less a space before it;
    where one is a beginning of the other, before the last element of the shorter."""
    n = min(len(chosen), len(rejected))
    idx = n - 1
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    if idx <= 0:
        raise DataError(f"{where}: `chosen` and `rejected` do not begin alike, so there is no prompt to extract from "
                        "them; give the prompt as `prompt`")
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _kind(value, name: str, where: str) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
            raise DataError(f"{where}: `{name}` is a list, but not of messages: each is an object with `role` and "
                            "`content`")
        return "messages"
    raise DataError(f"{where}: `{name}` is {type(value).__name__}, not a string or a list of messages")


def _fields(rec, where: str) -> tuple[dict, bool]:
    """The record's prompt/chosen/rejected (checked), and whether they are messages."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a JSON object was expected, found {type(rec).__name__}")
    missing = [k for k in COMPLETIONS if k not in rec]
    if missing:
        have = ", ".join(sorted(rec)[:8]) or "none"
        hint = ("; instruction records? prepare them with --instructions"
                if {"response", "messages"} & set(rec) else "")
        raise DataError(f"{where}: a preference record has `chosen` and `rejected` (and `prompt`, or one implicit "
                        f"in both): `{missing[0]}` is missing (it has: {have}){hint}")
    values = {k: rec[k] for k in FIELDS if k in rec}
    kinds = {k: _kind(v, k, where) for k, v in values.items()}
    if len(set(kinds.values())) > 1:
        said = ", ".join(f"`{k}` {'a string' if t == 'text' else 'messages'}" for k, t in kinds.items())
        raise DataError(f"{where}: mixed types ({said}): give prompt, chosen and rejected all as strings, or all as "
                        "lists of {role, content} messages")
    for k in COMPLETIONS:
        if not values[k]:
            raise DataError(f"{where}: `{k}` is empty: a pair needs two completions")
    return values, kinds["chosen"] == "messages"


def _text_ids(tok: Tokenizer, prompt: str, chosen: str, rejected: str) -> list[np.ndarray]:
    """prompt, prompt + chosen, prompt + rejected as the tokenizer's own call encodes them
    (TRL's `_tokenize`), the completions ending in EOS."""
    if isinstance(tok, HFTokenizer):
        eos = tok.tok.eos_token
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        ids = tok.tok([prompt, prompt + chosen, prompt + rejected])["input_ids"]
        return [np.asarray(i, np.int64) for i in ids]
    # bytes: EOS is an id no text encodes to, so it is always added
    p, pc, pr = (np.asarray(i, np.int64) for i in tok.encode_batch([prompt, prompt + chosen, prompt + rejected]))
    return [p, np.append(pc, tok.eos_id), np.append(pr, tok.eos_id)]


def _chat_ids(tok: Tokenizer, prompt: list, chosen: list, rejected: list, where: str) -> list[np.ndarray]:
    """prompt (with the generation prompt), prompt + chosen, prompt + rejected, rendered and
    tokenized by the chat template (TRL's `_tokenize`)."""
    if not tok.chat_template:
        raise DataError(f"{where}: conversational records need a tokenizer with a chat template (this one has none); "
                        "give strings, or a tokenizer with `chat_template`")

    def render(messages: list, generation_prompt: bool) -> np.ndarray:
        try:
            out = tok.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              add_generation_prompt=generation_prompt, tools=None)
        except Exception as e:  # noqa: BLE001 (the template's own error, e.g. a role it refuses)
            raise DataError(f"{where}: the chat template does not render it ({str(e).strip().splitlines()[0]})") \
                from None
        return np.asarray(out["input_ids"], np.int64)

    return [render(prompt, True), render(prompt + chosen, False), render(prompt + rejected, False)]


def _form(conversational: bool, implicit: bool) -> str:
    return ("conversational (lists of messages)" if conversational else "standard (strings)") + \
        (", prompt implicit" if implicit else ", with a prompt")


def pair_of(tok: Tokenizer, rec, where: str) -> Pair:
    """The record's pair, tokenized as TRL's DPOTrainer tokenizes it."""
    values, conversational = _fields(rec, where)
    implicit = "prompt" not in values
    if implicit:
        prompt, chosen, rejected = extract_prompt(values["chosen"], values["rejected"], where)
    else:
        prompt, chosen, rejected = (values[k] for k in FIELDS)
    if conversational:
        p, pc, pr = _chat_ids(tok, prompt, chosen, rejected, where)
    else:
        p, pc, pr = _text_ids(tok, prompt, chosen, rejected)
    n = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
    for name, ids in (("chosen", pc), ("rejected", pr)):
        if ids.size <= n:
            raise DataError(f"{where}: `{name}` leaves no token after the prompt once tokenized: a pair needs two "
                            "completions")
    return Pair(n, pc, pr, _form(conversational, implicit))


class OneFormat:
    """Every record in the first record's format: TRL decides from the first record whether
    prompts are implicit and whether EOS is added, for all of them."""

    def __init__(self):
        self.first: tuple[str, str] | None = None

    def check(self, form: str, where: str) -> None:
        if self.first is None:
            self.first = (form, where)
        elif form != self.first[0]:
            raise DataError(f"{where}: mixed types: this record is {form}, the first ({self.first[1]}) "
                            f"{self.first[0]}; one dataset holds records of one format")


def add_pairs(files, tok, writer, skipped, bar) -> None:
    """Each preference record of `files` into `writer` (a `ShardWriter`): its chosen and rejected rows, one format."""
    one = OneFormat()
    for f in files:
        for where, rec in pair_records(f, skipped):
            pair = pair_of(tok, rec, where)
            one.check(pair.form, where)
            for ids, mask in pair.examples():
                writer.add(ids, mask)
        bar.update(f.size)
