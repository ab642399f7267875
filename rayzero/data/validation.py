"""Validation data: documents held out of the training set, and the rows evaluation reads.

`data.val_fraction` holds out whole documents (whole instruction examples, whole preference
pairs: both sequences of a pair or neither): a fixed share of them, drawn by a generator of its own, so runs with different training seeds validate on the
same documents, and the training set is the rest, concatenated in order (`Subset`).
`data.val_path` names a dataset of its own instead.

Evaluation reads the same rows every time, a function of the data alone: for text, consecutive
windows of `seq_len + 1` tokens from the start of the validation documents (each document in
them alone with `data.document_masking`, as in training); for instruction examples, the
examples in order, packed as in training (each alone); for preference pairs, the pairs in order
(those training keeps), two rows each as in training. Evaluation batch e holds rows
[e·B, (e+1)·B) (pairs [e·B/2, (e+1)·B/2)), rank r of d its share of them, as in training;
rows (pairs) past the end are padding (no valid target), so the validation loss (summed over valid targets, divided by their count)
is the same at any world size.
"""

from __future__ import annotations

import numpy as np
import torch

from rayzero.data.batches import document_rows
from rayzero.data.errors import DataError
from rayzero.data.instruct import IGNORE_INDEX, pack, window_rows
from rayzero.data.microbatch import MicroBatch, micro_batches
from rayzero.data.preferences import EMPTY, Pairs, no_pairs_left

VAL_SEED = 0x5A11D


def held_out(num_docs: int, fraction: float, where: str, what: str = "documents") -> np.ndarray:
    """Which documents (or pairs: `what`) `fraction` holds out: a boolean mask, at least one and not all."""
    k = int(fraction * num_docs + 0.5)
    if k < 1:
        raise DataError(f"data.val_fraction={fraction:g} of the {num_docs} {what} in {where} holds out none; "
                        "raise it, or give data.val_path")
    if k >= num_docs:
        raise DataError(f"data.val_fraction={fraction:g} of the {num_docs} {what} in {where} leaves none to "
                        "train on")
    mask = np.zeros(num_docs, bool)
    mask[np.random.default_rng(VAL_SEED).permutation(num_docs)[:k]] = True
    return mask


class Subset:
    """The documents of `dataset` that `keep` selects, concatenated in order, read like a dataset."""

    def __init__(self, dataset, keep: np.ndarray, tag: str):
        self.dataset, self.uri, self.meta, self.kind = dataset, dataset.uri, dataset.meta, dataset.kind
        lengths = dataset.document_lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self._keep = keep
        self.document_lengths = lengths[keep]
        self.num_tokens = int(self.document_lengths.sum())
        self.fingerprint = f"{dataset.fingerprint}-{tag}"
        # runs of consecutive kept documents: (start in the dataset, length)
        segs: list[list[int]] = []
        for s, n, k in zip(starts.tolist(), lengths.tolist(), keep.tolist()):
            if not k:
                continue
            if segs and segs[-1][0] + segs[-1][1] == s:
                segs[-1][1] += n
            else:
                segs.append([s, n])
        self._src = np.array([s for s, _ in segs], np.int64)
        self._len = np.array([n for _, n in segs], np.int64)
        self._at = np.concatenate([[0], np.cumsum(self._len)])  # where each run starts here

    @property
    def masked(self) -> bool:
        return self.dataset.masked

    @property
    def prompt_lengths(self) -> np.ndarray:
        return self.dataset.prompt_lengths[self._keep]

    def _pieces(self, start: int, length: int):
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside {self.num_tokens} tokens")
        pos, end = start, start + length
        i = int(np.searchsorted(self._at, start, side="right")) - 1
        while pos < end:
            take = min(int(self._at[i + 1]), end) - pos
            yield int(self._src[i] + pos - self._at[i]), take
            pos += take
            i += 1

    def window(self, start: int, length: int) -> np.ndarray:
        parts = [self.dataset.window(s, n) for s, n in self._pieces(start, length)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def window_with_mask(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        parts = [self.dataset.window_with_mask(s, n) for s, n in self._pieces(start, length)]
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def split(dataset, fraction: float) -> tuple[Subset, Subset]:
    """(training documents, held-out documents) of `dataset`; of preference data, whole pairs."""
    if dataset.kind == "preferences":  # a pair is two consecutive documents
        held = np.repeat(held_out(dataset.document_lengths.size // 2, fraction, dataset.uri, "pairs"), 2)
    else:
        held = held_out(dataset.document_lengths.size, fraction, dataset.uri)
    return Subset(dataset, ~held, f"train{fraction:g}"), Subset(dataset, held, f"val{fraction:g}")


class ValidationRows:
    """One rank's share of the fixed validation rows, evaluation batch by batch; of preference
    data (`pairs`), pair i of a micro-batch in rows 2i (chosen) and 2i + 1 (rejected)."""

    def __init__(self, dataset, *, seq_len: int, global_batch: int, micro_batch: int, dp_rank: int,
                 dp_size: int, max_batches: int, document_masking: bool = False):
        self.dataset, self.seq_len, self.global_batch, self.micro_batch = dataset, seq_len, global_batch, micro_batch
        self.ends = np.cumsum(dataset.document_lengths) if document_masking and dataset.kind == "text" else None
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.rows_per_rank = global_batch // dp_size
        n = seq_len + 1
        self.pad = int(dataset.meta["eot"])
        self.pairs = dataset.kind == "preferences"
        per_batch = global_batch // 2 if self.pairs else global_batch  # pairs, else rows
        if self.pairs:
            if self.rows_per_rank % 2 or micro_batch % 2:
                raise ValueError(f"micro batch {micro_batch} and global batch {global_batch} / data-parallel size "
                                 f"{dp_size} count sequences, two a pair: both must be even")
            self.index = Pairs(dataset, seq_len)
            available = int(self.index.kept.size)
            if not available:
                raise no_pairs_left(self.index.counts, seq_len, f"the validation data ({dataset.uri})")
        elif dataset.kind == "instructions":
            lengths = dataset.document_lengths
            self.offsets = np.concatenate([[0], np.cumsum(lengths)])
            self.windows = pack(lengths, np.arange(lengths.size), n)
            available = len(self.windows)
        else:
            available = dataset.num_tokens // n
        if available == 0:
            raise DataError(f"the validation data ({dataset.uri}) holds {dataset.num_tokens} tokens, fewer than one "
                            f"row of train.seq_len + 1 = {n}")
        self.num_rows = min(available, max_batches * per_batch)  # pairs, for preference data
        self.num_batches = -(-self.num_rows // per_batch)

    def _rows(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(tokens, labels, where each token's example starts or None) of rows `ids`."""
        n = self.seq_len + 1
        real = [i for i in ids if i < self.num_rows]
        documents = None
        if self.dataset.kind == "instructions":
            tokens, labels, documents = window_rows(self.dataset, self.offsets, [self.windows[i] for i in real],
                                                    self.seq_len, self.pad)
        else:
            tokens = np.stack([self.dataset.window(i * n, n) for i in real]) if real else np.zeros((0, n), np.int64)
            labels = tokens.copy()
            if self.ends is not None:
                labels, documents = document_rows(self.ends, np.asarray(real, np.int64) * n, tokens)
        missing = len(ids) - len(real)
        if missing:
            tokens = np.concatenate([tokens, np.full((missing, n), self.pad, np.int64)])
            labels = np.concatenate([labels, np.full((missing, n), IGNORE_INDEX, np.int64)])
            if documents is not None:
                documents = np.concatenate([documents, np.zeros((missing, n), np.int64)])
        return tokens, labels, documents

    def _pair_rows(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        per_rank = self.rows_per_rank // 2
        first = batch * (self.global_batch // 2) + self.dp_rank * per_rank
        return self.index.rows([i if i < self.num_rows else EMPTY for i in range(first, first + per_rank)])

    def microbatches(self, batch: int) -> list[MicroBatch]:
        if self.pairs:
            tokens, labels, documents = *self._pair_rows(batch), None
        else:
            first = batch * self.global_batch + self.dp_rank * self.rows_per_rank
            tokens, labels, documents = self._rows(list(range(first, first + self.rows_per_rank)))
        return micro_batches(torch.from_numpy(tokens), torch.from_numpy(labels),
                             None if documents is None else torch.from_numpy(documents), self.micro_batch)


def validation_split(cfg, dataset):
    """(what training reads, what evaluation reads or None) for a run's config: documents held
    out of `dataset` by `data.val_fraction`, or the dataset at `data.val_path`."""
    if cfg.data.val_fraction:
        return split(dataset, cfg.data.val_fraction)
    if cfg.data.val_path:
        from rayzero.data.tokens import TokenDataset

        return dataset, TokenDataset(cfg.data.val_path, storage_cfg=cfg.checkpoint)
    return dataset, None
