"""Instruction examples, made from JSON records when data is prepared (`rayzero data prepare SRC OUT
--instructions`); packing them into windows for training is `instruct`'s.

Each JSON record is either

    {"prompt": "...", "response": "..."}              [BOS] prompt response EOS
    {"messages": [{"role": ..., "content": ...}, ...]}  rendered with the tokenizer's chat template

and becomes an example: its token ids, and a mask that is 1 on the tokens the model learns to
produce (the response and its EOS; each assistant turn as the template renders it, its
end-of-turn marker included) and 0 elsewhere. The dataset is the examples' ids in order, a
`mask` column beside `tokens`; `documents.parquet` holds each example's length.
"""

from __future__ import annotations

import numpy as np

from rayzero.data.errors import DataError
from rayzero.data.tokenizer import Tokenizer


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    return tok.encode_batch([text])[0].astype(np.int64)


def prompt_response(tok: Tokenizer, prompt: str, response: str) -> tuple[np.ndarray, np.ndarray]:
    p, r = tok.encode_batch([prompt, response])
    head = [] if tok.bos_id is None else [tok.bos_id]
    ids = np.concatenate([np.asarray(head, np.int64), p, r, [tok.eos_id]]).astype(np.int64)
    mask = np.zeros(ids.size, np.uint8)
    mask[len(head) + p.size:] = 1
    return ids, mask


def chat(tok: Tokenizer, messages: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The conversation as the chat template renders it; the mask covers each assistant turn:
    the tokens between the rendering of the turns before it (with the generation prompt) and
    the rendering through it."""
    template = tok.chat_template
    if not template:
        raise DataError(f"{where}: `messages` need a tokenizer with a chat template (this one has none); "
                        "use `prompt`/`response` records, or a tokenizer with `chat_template`")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise DataError(f"{where}: `messages` is a list of {{\"role\", \"content\"}} objects")

    def render(upto: int, generation_prompt: bool) -> np.ndarray:
        text = tok.tok.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation_prompt)
        return _encode(tok, text)

    ids = render(len(messages), False)
    mask = np.zeros(ids.size, np.uint8)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(i, True), render(i + 1, False)
        if not (np.array_equal(ids[: through.size], through) and np.array_equal(through[: before.size], before)):
            raise DataError(f"{where}: the chat template does not render the conversation turn by turn (the text "
                            f"through message {i} is not a prefix of the whole), so the response tokens cannot be "
                            "told apart")
        mask[before.size: through.size] = 1
    if not mask.any():
        raise DataError(f"{where}: no assistant message: nothing to learn from")
    return ids, mask


def example_of(tok: Tokenizer, rec, where: str) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(rec, dict) and "messages" in rec:
        return chat(tok, rec["messages"], where)
    if isinstance(rec, dict) and "prompt" in rec and "response" in rec:
        p, r = rec["prompt"], rec["response"]
        if not isinstance(p, str) or not isinstance(r, str):
            raise DataError(f"{where}: `prompt` and `response` must be strings")
        return prompt_response(tok, p, r)
    have = ", ".join(sorted(rec)[:8]) if isinstance(rec, dict) else type(rec).__name__
    hint = ("; preference pairs? prepare them with --preferences"
            if isinstance(rec, dict) and {"chosen", "rejected"} & set(rec) else "")
    raise DataError(f"{where}: an instruction record has `prompt` and `response`, or `messages` (it has: {have})"
                    f"{hint}")


def add_examples(files, tok, writer, skipped, bar) -> None:
    """Each instruction record of `files` into `writer` (a `ShardWriter`): its tokens and loss mask."""
    from rayzero.data.sources import json_records

    for f in files:
        if f.format != "json":
            raise DataError(f"{f.uri}: instruction data is JSON lines (.jsonl) of prompt/response or messages records")
        for where, rec in json_records(f, skipped):
            ids, mask = example_of(tok, rec, where)
            writer.add(ids, mask)
        bar.update(f.size)
