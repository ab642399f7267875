"""Preference pairs in training (`train.objective=dpo`): rows of chosen and rejected sequences
for a pair loss, cut as TRL's DPOTrainer cuts them (the pairs themselves are made when data is
prepared: `pairs`). A pair is two consecutive examples of the dataset, prompt + chosen then
prompt + rejected, their mask 1 on the completion's tokens.

Truncation is TRL's with `max_length` = seq_len + 1 and `truncation_mode="keep_start"`: each
sequence keeps its first seq_len + 1 tokens, of which the model reads seq_len (the last is
only a target), so its logits are TRL's at every position kept. A pair whose prompt alone
fills seq_len + 1 tokens would keep no completion token and is dropped, as TRL drops it
(`len(prompt_ids) < max_length`); `pair_counts` says how many pairs are dropped and how many cut.

Batch sizes count sequences: a pair is two rows. In epoch e the kept pairs are taken in a
permutation drawn from (seed, 2, e); step k takes pairs [k·P, (k+1)·P) of it, P = global
batch / 2, and the last step of an epoch is filled up with empty pairs (no valid target), so
every pair is seen once per epoch. Rank r of d takes pairs [r·P/d, (r+1)·P/d) of the step; in
each micro-batch pair i is rows 2i (chosen) and 2i + 1 (rejected). Row t's labels are its
tokens where the mask is 1 (never at position 0), IGNORE_INDEX elsewhere and on padding (the
end-of-text id). All of this is a function of (seed, k) alone: the same step sees the same
pairs at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from rayzero.data.batches import RankBatches
from rayzero.data.errors import DataError
from rayzero.data.microbatch import MicroBatch, micro_batches
from rayzero.data.instruct import window_rows

EMPTY = -1  # a pair that fills a step or an evaluation batch up: no valid target


@dataclass(frozen=True)
class PairCounts:
    """What training at one sequence length makes of a dataset's pairs."""

    pairs: int  # in the dataset
    dropped: int  # the prompt alone fills seq_len + 1 tokens: left out, as TRL leaves it out
    truncated: int  # kept, with chosen or rejected longer than seq_len + 1 tokens: cut to them

    @property
    def kept(self) -> int:
        return self.pairs - self.dropped


class Pairs:
    """A preference dataset's pairs at one sequence length: where each lies, which are kept,
    and their rows."""

    def __init__(self, dataset, seq_len: int):
        if dataset.kind != "preferences":
            raise DataError(f"{dataset.uri} holds {dataset.kind}, not preference pairs (prepare them with "
                            "--preferences)")
        lengths = dataset.document_lengths
        if lengths.size % 2:
            raise DataError(f"{dataset.uri}: {lengths.size} sequences, an odd number: not pairs")
        self.dataset, self.seq_len = dataset, seq_len
        self.pad = int(dataset.meta["eot"])
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        n = seq_len + 1
        prompts = dataset.prompt_lengths[0::2]  # the same in both sequences of a pair
        self.kept = np.flatnonzero(prompts < n)  # pair ids, in order
        longest = np.maximum(lengths[0::2], lengths[1::2])
        self.counts = PairCounts(pairs=int(prompts.size), dropped=int(prompts.size - self.kept.size),
                                 truncated=int((longest[self.kept] > n).sum()))

    def rows(self, pairs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, labels) of shape (2·len(pairs), seq_len + 1): the i-th of `pairs` (an index
        into `kept`, or EMPTY) as rows 2i (chosen) and 2i + 1 (rejected). A row holds one
        sequence, padded after its end: causal attention keeps the padding out of it."""
        windows: list[list[int]] = []
        for p in pairs:
            q = int(self.kept[p]) if p != EMPTY else None
            windows += [[], []] if q is None else [[2 * q], [2 * q + 1]]
        return window_rows(self.dataset, self.offsets, windows, self.seq_len, self.pad)[:2]


def pair_counts(dataset, seq_len: int) -> PairCounts:
    """How many of the dataset's pairs training at `seq_len` drops (prompt too long) and cuts."""
    return Pairs(dataset, seq_len).counts


def no_pairs_left(counts: PairCounts, seq_len: int, where: str) -> DataError:
    return DataError(f"{where}: the prompt of every one of its {counts.pairs} pairs fills train.seq_len + 1 = "
                     f"{seq_len + 1} tokens, leaving no completion to learn from (TRL drops such pairs); raise "
                     "train.seq_len")


class PairEpochs:
    """Which pairs each step of each epoch holds: a function of (seed, step)."""

    def __init__(self, num_pairs: int, seed: int, pairs_per_step: int):
        if num_pairs < 1:
            raise DataError("no preference pairs to train on")
        self.num_pairs, self.seed, self.pairs_per_step = num_pairs, seed, pairs_per_step

    @lru_cache(maxsize=4)
    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 2, epoch]).permutation(self.num_pairs)

    def steps_in(self, epoch: int) -> int:
        """Steps in epoch `epoch` (the same in every epoch)."""
        return -(-self.num_pairs // self.pairs_per_step)

    def steps(self, epochs: int) -> int:
        """The number of steps in the first `epochs` epochs."""
        return epochs * self.steps_in(0)

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within it)."""
        return divmod(step, self.steps_in(0))

    def step_pairs(self, step: int) -> np.ndarray:
        """The P pairs of `step` (indices of kept pairs; EMPTY fills the last step of an epoch)."""
        epoch, k = self.locate(step)
        mine = self.order(epoch)[k * self.pairs_per_step: (k + 1) * self.pairs_per_step]
        return np.concatenate([mine, np.full(self.pairs_per_step - mine.size, EMPTY, np.int64)])


def pair_epochs(dataset, seed: int, global_batch: int, seq_len: int) -> PairEpochs:
    """The epochs training at (seed, global batch in sequences, seq_len) takes over the dataset's kept pairs."""
    pairs = Pairs(dataset, seq_len)
    if not pairs.kept.size:
        raise no_pairs_left(pairs.counts, seq_len, dataset.uri)
    return PairEpochs(int(pairs.kept.size), seed, global_batch // 2)


class PreferenceBatches(RankBatches):
    """One rank's rows of every step's pairs: inputs and labels (-100 where no loss), pair i of
    a micro-batch in rows 2i and 2i + 1; reading ahead, checking and resuming as `RankBatches`
    does. `global_batch` and `micro_batch` count sequences (both even)."""

    masks_labels = True
    pairs = True  # rows 2i and 2i + 1 are one pair's chosen and rejected

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        if self.micro_batch % 2 or self.rows_per_rank % 2:
            raise ValueError(f"micro batch {self.micro_batch} and global batch {self.global_batch} / data-parallel "
                             f"size {self.dp_size} count sequences, two a pair: both must be even")
        self.index = Pairs(dataset, self.seq_len)
        if not self.index.kept.size:
            raise no_pairs_left(self.index.counts, self.seq_len, dataset.uri)
        self.epochs = PairEpochs(int(self.index.kept.size), self.seed, self.global_batch // 2)

    @property
    def counts(self) -> PairCounts:
        return self.index.counts

    def rank_rows(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.rows_per_rank // 2
        mine = self.epochs.step_pairs(step)[self.dp_rank * per_rank: (self.dp_rank + 1) * per_rank]
        tokens, labels = self.index.rows(mine.tolist())
        return torch.from_numpy(tokens), torch.from_numpy(labels)

    def _split(self, rows) -> list[MicroBatch]:
        return micro_batches(*rows, None, self.micro_batch)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "seq_len": self.seq_len}  # which pairs are kept depends on it

    def load_state_dict(self, state: dict) -> None:
        if state.get("seq_len", self.seq_len) != self.seq_len:
            raise ValueError(f"data state was saved with seq_len={state['seq_len']!r}, this job has {self.seq_len!r} "
                             "(which preference pairs are kept depends on it)")
        super().load_state_dict(state)
