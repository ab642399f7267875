"""Which samples make up each step's global batch, and which part of it a rank reads.

The global batch at step k is a function of (seed, k, global batch size) alone: B windows of
``seq_len + 1`` tokens at offsets drawn from a generator seeded with (seed, k). Rank r of d
reads rows [r·B/d, (r+1)·B/d). The same step therefore sees the same samples at any world
size and under any strategy.

A window is one sequence (`RankBatches`), or with `data.document_masking` each document in it
stays alone (`DocumentBatches`): its tokens attend to its own earlier tokens only, its positions
restart where it starts (the document cut by the window's start from the window's first token),
and no target crosses from one document into the next.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from rayzero.data.microbatch import MicroBatch, micro_batches
from rayzero.data.tokens import TokenDataset
from rayzero.sharding.vocab_parallel import IGNORE_INDEX


def global_batch_offsets(seed: int, step: int, global_batch: int, num_tokens: int, seq_len: int) -> np.ndarray:
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - seq_len, size=global_batch, dtype=np.int64)


class RankBatches:
    """One data-parallel rank's slice of every step's global batch, split into micro-batches."""

    masks_labels = False  # plain text: every target counts (no IGNORE_INDEX labels)
    pairs = False  # preference data: rows 2i and 2i + 1 are one pair's chosen and rejected

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seed: int,
        global_batch: int,
        micro_batch: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
    ):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"global batch {global_batch} is not divisible by micro batch {micro_batch} "
                f"x data-parallel size {dp_size}"
            )
        self.dataset = dataset
        self.seed, self.global_batch, self.micro_batch = seed, global_batch, micro_batch
        self.seq_len, self.dp_rank, self.dp_size = seq_len, dp_rank, dp_size
        self.rows_per_rank = global_batch // dp_size
        self.next_step = 0
        # Reading step k+1's rows overlaps step k's compute: the reads release the GIL.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="rayzero-data")
        self._ahead: tuple[int, Future] | None = None

    @property
    def num_microbatches(self) -> int:
        return self.rows_per_rank // self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        """Target tokens in the whole global batch: the loss is averaged over these."""
        return self.global_batch * self.seq_len

    def offsets(self, step: int) -> np.ndarray:
        """Where this rank's rows of step `step` start in the corpus."""
        offsets = global_batch_offsets(
            self.seed, step, self.global_batch, self.dataset.num_tokens, self.seq_len
        )
        return offsets[self.dp_rank * self.rows_per_rank : (self.dp_rank + 1) * self.rows_per_rank]

    def rank_rows(self, step: int) -> torch.Tensor:
        """This rank's rows of step `step`: int64 tensor (rows_per_rank, seq_len + 1)."""
        return self.windows_at(self.offsets(step))

    def windows_at(self, offsets: np.ndarray) -> torch.Tensor:
        """The windows of `seq_len + 1` tokens at `offsets` of the corpus, one a row."""
        return torch.from_numpy(np.stack([self.dataset.window(int(o), self.seq_len + 1) for o in offsets]))

    def microbatches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of step `step`; advances the data position past `step`."""
        if self._ahead is not None and self._ahead[0] == step:
            rows = self._ahead[1].result()
        else:
            rows = self.rank_rows(step)
        self._ahead = (step + 1, self._reader.submit(self.rank_rows, step + 1))
        self.next_step = step + 1
        return self._split(rows)

    def close(self) -> None:
        """Stop the read-ahead thread (a rank that leaves its group and joins a new one makes
        new batches; the old reader would otherwise linger until garbage collection)."""
        self._ahead = None
        self._reader.shutdown(wait=True, cancel_futures=True)

    def _split(self, rows: torch.Tensor) -> list[MicroBatch]:
        return [MicroBatch(mb[:, :-1], mb[:, 1:]) for mb in rows.split(self.micro_batch)]

    def state_dict(self) -> dict:
        return {
            "next_step": self.next_step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "dataset": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("dataset", "seed", "global_batch"):
            if state[key] != mine[key]:
                raise ValueError(f"data state was saved with {key}={state[key]!r}, this job has {mine[key]!r}")
        self.next_step = int(state["next_step"])


def document_rows(ends: np.ndarray, offsets: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels, documents) of text windows `tokens` [rows, n] read at `offsets` of a corpus whose
    documents end at `ends` (cumulative lengths): documents[r, t] is the index in row r where
    token t's document starts (0 for the one the window cut), and a label is IGNORE_INDEX where
    its token starts a document (it is never predicted from the one before)."""
    at = offsets[:, None] + np.arange(tokens.shape[1])
    starts = np.concatenate([[0], ends])[np.searchsorted(ends, at, side="right")]
    documents = np.maximum(starts - offsets[:, None], 0)
    labels = tokens.copy()
    labels[:, 1:][documents[:, 1:] != documents[:, :-1]] = IGNORE_INDEX
    return labels, documents


class DocumentBatches(RankBatches):
    """`RankBatches`' windows with each document in them alone (`data.document_masking`; see the
    module doc): rows of (tokens, labels, documents)."""

    masks_labels = True  # a document's first token is no target: the step's targets are counted

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.ends = np.cumsum(dataset.document_lengths)

    def rank_rows(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        offsets = self.offsets(step)
        tokens = self.windows_at(offsets)
        return (tokens, *(torch.from_numpy(a) for a in document_rows(self.ends, offsets, tokens.numpy())))

    def _split(self, rows) -> list[MicroBatch]:
        return micro_batches(*rows, self.micro_batch)
