"""Instruction data in training: examples whose loss is on the response only (made from JSON
records when data is prepared: `examples`), packed into windows.

Training (`InstructionBatches`): in epoch e the examples are taken in a permutation drawn from
(seed, e) and packed in that order into windows of `seq_len + 1` tokens: an example goes into
the current window if it fits, else starts the next one (an example longer than a window is
cut to it); the rest of a window is padding. A target counts only if its token is masked in
and belongs to the same example as the token before it, so no label crosses an example
boundary, and every example stays alone in its window: each token's `documents` entry is where
its example starts (`microbatch.py`), so that it attends to its own example only and its
position restarts there, as if it had been trained by itself. Step k takes windows
[k·B, (k+1)·B) of its epoch; the last step of an epoch is
filled up with empty windows (no valid target), so every example is seen exactly once per
epoch. All of this is a function of (seed, k) alone: the same step sees the same examples at
any world size.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from rayzero.data.batches import RankBatches
from rayzero.data.errors import DataError
from rayzero.data.microbatch import MicroBatch, micro_batches

IGNORE_INDEX = -100


# -- packing ---------------------------------------------------------------------------------

def pack(lengths: np.ndarray, order: np.ndarray, window: int) -> list[list[int]]:
    """Examples (in `order`) into windows of `window` tokens, first fit in order."""
    windows: list[list[int]] = []
    used = window
    for i in order.tolist():
        n = min(int(lengths[i]), window)
        if used + n > window:
            windows.append([])
            used = 0
        windows[-1].append(i)
        used += n
    return windows


class Epochs:
    """Which windows each step of each epoch holds: a function of (seed, step)."""

    def __init__(self, lengths: np.ndarray, seed: int, global_batch: int, window: int):
        self.lengths, self.seed, self.global_batch, self.window = lengths, seed, global_batch, window
        self.truncated = int((lengths > window).sum())
        self._starts = [0]  # first step of each epoch packed so far

    @lru_cache(maxsize=4)
    def windows(self, epoch: int) -> list[list[int]]:
        order = np.random.default_rng([self.seed, 1, epoch]).permutation(self.lengths.size)
        return pack(self.lengths, order, self.window)

    def steps_in(self, epoch: int) -> int:
        return -(-len(self.windows(epoch)) // self.global_batch)

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within it)."""
        while self._starts[-1] <= step:
            self._starts.append(self._starts[-1] + self.steps_in(len(self._starts) - 1))
        epoch = int(np.searchsorted(self._starts, step, side="right")) - 1
        return epoch, step - self._starts[epoch]

    def steps(self, epochs: int) -> int:
        """The number of steps in the first `epochs` epochs."""
        return sum(self.steps_in(e) for e in range(epochs))

    def step_windows(self, step: int) -> list[list[int]]:
        """The B windows of `step` (empty lists fill the last step of an epoch)."""
        epoch, k = self.locate(step)
        ws = self.windows(epoch)[k * self.global_batch: (k + 1) * self.global_batch]
        return ws + [[] for _ in range(self.global_batch - len(ws))]


def window_rows(dataset, offsets: np.ndarray, windows: list[list[int]], seq_len: int,
                pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, labels, documents) of shape (len(windows), seq_len + 1) for windows of examples
    (indices into `offsets`): labels[t] is the target of position t - 1, IGNORE_INDEX where it
    takes no part in the loss: masked out, padding, or the first token of an example;
    documents[t] the index where token t's example starts (the padding after the last example
    is one of its own)."""
    n = seq_len + 1
    tokens = np.full((len(windows), n), pad, np.int64)
    labels = np.full((len(windows), n), IGNORE_INDEX, np.int64)
    documents = np.zeros((len(windows), n), np.int64)
    for row, examples in enumerate(windows):
        at = 0
        for i in examples:
            start, length = int(offsets[i]), min(int(offsets[i + 1] - offsets[i]), n)
            ids, mask = dataset.window_with_mask(start, length)
            tokens[row, at: at + length] = ids
            keep = mask.astype(bool)
            keep[0] = False  # the first token of an example is never predicted from the one before
            labels[row, at: at + length] = np.where(keep, ids, IGNORE_INDEX)
            documents[row, at: at + length] = at
            at += length
        documents[row, at:] = at
    return tokens, labels, documents


class InstructionBatches(RankBatches):
    """One rank's rows of every step's packed windows: inputs and labels (-100 where no loss);
    reading ahead, checking and resuming as `RankBatches` does."""

    masks_labels = True

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        if dataset.kind != "instructions":
            raise DataError(f"{dataset.uri} holds text, not instruction examples")
        lengths = dataset.document_lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.epochs = Epochs(lengths, self.seed, self.global_batch, self.seq_len + 1)
        self.pad = int(dataset.meta["eot"])

    def window_rows(self, windows: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return window_rows(self.dataset, self.offsets, windows, self.seq_len, self.pad)

    def rank_rows(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        windows = self.epochs.step_windows(step)
        mine = windows[self.dp_rank * self.rows_per_rank: (self.dp_rank + 1) * self.rows_per_rank]
        return tuple(torch.from_numpy(a) for a in self.window_rows(mine))

    def _split(self, rows) -> list[MicroBatch]:
        return micro_batches(*rows, self.micro_batch)

