"""`rayzero data prepare … --ray`: the same dataset, tokenized with Ray Data across a cluster.

    files ──from_items──▶ read (flat_map: a file's documents, or instruction or preference records)
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


def _read(row: dict, fields: Fields, strict_utf8: bool, kind: str, storage_cfg) -> Iterator[dict]:
    """One file's documents (instruction or preference records as JSON text), and what was
    skipped in it."""
    f = list_sources(row["uri"], storage_cfg=storage_cfg)[0]
    skipped: list[str] | None = None if strict_utf8 else []
    if kind == "preferences":
        from rayzero.data.pairs import pair_records

        for where, rec in pair_records(f, skipped):
            yield {"kind": "doc", "doc": json.dumps(rec), "where": where, "read": 0}
    elif kind == "instructions":
        if f.format != "json":
            raise DataError(f"{f.uri}: instruction data is JSON lines (.jsonl) of prompt/response or messages records")
        for where, rec in json_records(f, skipped):
            yield {"kind": "doc", "doc": json.dumps(rec), "where": where, "read": 0}
    else:
        for text in documents(f, fields, skipped):
            yield {"kind": "doc", "doc": text, "where": "", "read": 0}
    for where in skipped or []:
        yield {"kind": "skipped", "doc": "", "where": where, "read": 0}
    yield {"kind": "done", "doc": "", "where": "", "read": row["size"]}  # for the progress bar


class _Tokenize:
    """A Ray Data actor: token ids (and, for instructions and pairs, loss masks) of a batch of
    documents. A pair's two sequences are one row: `cut` ids of the first, then the second."""

    def __init__(self, tok: Tokenizer, kind: str, dtype: str):
        self.tok, self.kind, self.dtype = tok, kind, np.dtype(dtype)

    def __call__(self, batch: dict) -> dict:
        kinds, docs, wheres = list(batch["kind"]), list(batch["doc"]), list(batch["where"])
        keep = [i for i, k in enumerate(kinds) if k == "doc"]
        ids = [b""] * len(docs)
        masks = [b""] * len(docs)
        cuts, forms = [0] * len(docs), [""] * len(docs)
        if self.kind == "preferences":
            from rayzero.data.pairs import pair_of

            for i in keep:
                pair = pair_of(self.tok, json.loads(docs[i]), wheres[i])
                (c, cm), (r, rm) = pair.examples()
                ids[i] = np.concatenate([c, r]).astype(self.dtype).tobytes()
                masks[i] = np.concatenate([cm, rm]).tobytes()
                cuts[i], forms[i] = int(c.size), pair.form
        elif self.kind == "instructions":
            from rayzero.data.examples import example_of

            for i in keep:
                tokens, mask = example_of(self.tok, json.loads(docs[i]), wheres[i])
                ids[i], masks[i] = tokens.astype(self.dtype).tobytes(), mask.astype(np.uint8).tobytes()
        else:
            for i, doc in zip(keep, self.tok.documents([docs[i] for i in keep], self.dtype)):
                ids[i] = doc.tobytes()
        return {"kind": kinds, "ids": ids, "mask": masks, "cut": cuts, "form": forms, "where": wheres,
                "read": list(batch["read"])}


def prepare_on_ray(src, out: str, workers: int | None = None, **kwargs) -> dict:
    """`rayzero.data.tokens.prepare(src, out, **kwargs)` with the tokenizing done by Ray Data on
    `workers` workers (default: the cluster's CPUs) of the Ray this process is connected to."""
    from functools import partial

    from rayzero.data.tokens import prepare

    return prepare(src, out, tokenize_with=partial(_fill, workers=workers), **kwargs)


def _fill(files_src: str, writer, tok: Tokenizer, *, pattern: str, exclude: tuple[str, ...], fields: Fields,
          strict_utf8: bool, instructions: bool, preferences: bool, storage_cfg, bar, batch_docs: int,
          workers: int | None) -> list[str]:
    """Fill `writer` with the documents under `files_src`, tokenized by Ray Data; the skipped
    inputs (not UTF-8)."""
    import ray
    import ray.data

    from rayzero.data.pairs import OneFormat

    kind = "preferences" if preferences else "instructions" if instructions else "text"

    files = list_sources(files_src, pattern, exclude, storage_cfg)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # ours, in bytes of text, is the one bar
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its notes on plans and progress bars are not ours
    workers = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    # A few blocks of files per worker: a task per file would cost more than reading most files.
    blocks = min(len(files), 4 * workers)
    ds = ray.data.from_items([{"uri": f.uri, "size": f.size} for f in files], override_num_blocks=blocks)
    ds = ds.flat_map(_read, num_cpus=0.25, fn_kwargs={"fields": fields, "strict_utf8": strict_utf8, "kind": kind,
                                                      "storage_cfg": storage_cfg})
    # Reading is mostly waiting on storage: a quarter of a CPU, so that the tokenizers, three
    # quarters each, leave room for it on a machine with as many CPUs as workers.
    # Documents need only the Rust tokenizer (quick to ship and load); chat templates need transformers'.
    sent = tok if kind != "text" else tok.for_documents()
    ds = ds.map_batches(_Tokenize, fn_constructor_args=(sent, kind, writer.dtype.name), batch_size=batch_docs,
                        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=0.75)
    skipped: list[str] = []
    one = OneFormat()  # in the records' order, as `prepare` checks it
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for row, ids, mask, cut, form, where, read in zip(batch["kind"], batch["ids"], batch["mask"], batch["cut"],
                                                              batch["form"], batch["where"], batch["read"]):
                if row == "done":
                    bar.update(int(read))
                elif row == "skipped":
                    skipped.append(str(where))
                elif kind == "preferences":
                    one.check(str(form), str(where))
                    ids, mask = np.frombuffer(ids, dtype=writer.dtype), np.frombuffer(mask, dtype=np.uint8)
                    writer.add(ids[:cut], mask[:cut])
                    writer.add(ids[cut:], mask[cut:])
                else:
                    writer.add(np.frombuffer(ids, dtype=writer.dtype),
                               np.frombuffer(mask, dtype=np.uint8) if instructions else None)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), DataError) else None
        if cause is not None:
            raise DataError(str(cause)) from None
        raise
    return skipped
