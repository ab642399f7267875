"""`rayzero data prepare … --ray`: the same dataset, tokenized with Ray Data across a cluster.

    files ──from_items──▶ read (flat_map: a file's documents, or instruction records)
          ──map_batches──▶ tokenize (a pool of actors, each loading the tokenizer once)
          ──in order──▶ the driver writes the shards and meta.json, as `prepare` does

Ray Data keeps the blocks in order (`preserve_order`), so the documents reach the writer in
the single-process order and the shards, the fingerprint and meta.json come out the same; the
tokenizing, which is where the time goes, runs on as many workers as asked. The sources must
be readable from every node (object storage, or a filesystem they share).
"""

from __future__ import annotations

import json
import logging
from typing import Iterator

import numpy as np

from rayzero.data.errors import DataError
from rayzero.data.sources import Fields, documents, json_records, list_sources
from rayzero.data.tokenizer import Tokenizer


def _read(row: dict, fields: Fields, strict_utf8: bool, instructions: bool, storage_cfg) -> Iterator[dict]:
    """One file's documents (instruction records as JSON text), and what was skipped in it."""
    f = list_sources(row["uri"], storage_cfg=storage_cfg)[0]
    skipped: list[str] | None = None if strict_utf8 else []
    if instructions:
        if f.format != "json":
            raise DataError(f"{f.uri}: instruction data is JSON lines (.jsonl) of prompt/response or messages records")
        for where, rec in json_records(f, skipped):
            yield {"doc": json.dumps(rec), "where": where, "skipped": ""}
    else:
        for text in documents(f, fields, skipped):
            yield {"doc": text, "where": "", "skipped": ""}
    for where in skipped or []:
        yield {"doc": "", "where": "", "skipped": where}


class _Tokenize:
    """A Ray Data actor: token ids (and, for instructions, loss masks) of a batch of documents."""

    def __init__(self, tok: Tokenizer, instructions: bool, dtype: str):
        self.tok, self.instructions, self.dtype = tok, instructions, np.dtype(dtype)

    def __call__(self, batch: dict) -> dict:
        docs, wheres, skipped = list(batch["doc"]), list(batch["where"]), list(batch["skipped"])
        keep = [i for i, s in enumerate(skipped) if not s]
        ids = [b""] * len(docs)
        masks = [b""] * len(docs)
        if self.instructions:
            from rayzero.data.instruct import example_of

            for i in keep:
                tokens, mask = example_of(self.tok, json.loads(docs[i]), wheres[i])
                ids[i], masks[i] = tokens.astype(self.dtype).tobytes(), mask.astype(np.uint8).tobytes()
        else:
            for i, doc in zip(keep, self.tok.documents([docs[i] for i in keep], self.dtype)):
                ids[i] = doc.tobytes()
        return {"ids": ids, "mask": masks, "skipped": skipped}


def prepare_on_ray(src, out: str, workers: int | None = None, **kwargs) -> dict:
    """`rayzero.data.tokens.prepare(src, out, **kwargs)` with the tokenizing done by Ray Data on
    `workers` workers (default: the cluster's CPUs) of the Ray this process is connected to."""
    from functools import partial

    from rayzero.data.tokens import prepare

    return prepare(src, out, tokenize_with=partial(_fill, workers=workers), **kwargs)


def _fill(files_src: str, writer, tok: Tokenizer, *, pattern: str, exclude: tuple[str, ...], fields: Fields,
          strict_utf8: bool, instructions: bool, storage_cfg, bar, batch_docs: int, workers: int | None) -> list[str]:
    """Fill `writer` with the documents under `files_src`, tokenized by Ray Data; the skipped
    inputs (not UTF-8)."""
    import ray
    import ray.data

    files = list_sources(files_src, pattern, exclude, storage_cfg)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # ours, in bytes of text, is the one bar
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its notes on plans and progress bars are not ours
    ds = ray.data.from_items([{"uri": f.uri, "size": f.size} for f in files], override_num_blocks=len(files))
    ds = ds.flat_map(_read, num_cpus=0.25, fn_kwargs={"fields": fields, "strict_utf8": strict_utf8, "instructions": instructions,
                                       "storage_cfg": storage_cfg})
    workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    # Reading is mostly waiting on storage: a quarter of a CPU, so that the tokenizers, three
    # quarters each, leave room for it on a machine with as many CPUs as workers.
    ds = ds.map_batches(_Tokenize, fn_constructor_args=(tok, instructions, writer.dtype.name), batch_size=batch_docs,
                        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=0.75)
    skipped: list[str] = []
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for ids, mask, where in zip(batch["ids"], batch["mask"], batch["skipped"]):
                if where:
                    skipped.append(str(where))
                    continue
                tokens = np.frombuffer(ids, dtype=writer.dtype)
                writer.add(tokens, np.frombuffer(mask, dtype=np.uint8) if instructions else None)
                bar.update(0)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), DataError) else None
        if cause is not None:
            raise DataError(str(cause)) from None
        raise
    bar.update(sum(f.size for f in files))
    return skipped
