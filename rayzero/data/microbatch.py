"""A micro-batch: what one forward and backward of a rank takes, and how it is split. The same
object goes from the data to the loss on every path (plain, through pipeline stages, split by
context parallelism, preference pairs); a runner moves and splits it without knowing its fields.

    tokens       [B, T]  the input ids
    targets      [B, T]  each input's next token, IGNORE_INDEX where it takes no part in the loss
                         (`loss_mask`: where it does)
    documents    [B, T]  packed rows only: for each token, the index in its row of the first
                         token of the example (document) it belongs to (`example_ids`); None for
                         rows that hold one sequence each (text windows, preference rows)
    row_fields   {name: [B, ...]}  an objective's own values per row (a pair's completion tokens,
                         a sequence's weight, an advantage): kept whole when cp splits the tokens
    token_fields {name: [B, T, ...]}  its own values per token (a weight, an old log-probability):
                         split with the tokens

Packed examples stay alone through `documents`: a token attends only to the earlier tokens of
its own example (keys from `documents` to itself), and its position is its index in the row less
`documents` (positions restart at every example). A row's padding is one more example of its own.
The model seam turns them into the model's own mechanism (`models/spec.py`); context
parallelism splits them with the tokens, their values still whole-row indices (`split`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rayzero.sharding.vocab_parallel import IGNORE_INDEX


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None = None
    row_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def packed(self) -> bool:
        """Whether the rows hold examples packed together (each attending to itself alone)."""
        return self.documents is not None

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, T] bool: the targets that take part in the loss."""
        return self.targets != IGNORE_INDEX

    @property
    def example_ids(self) -> torch.Tensor | None:
        """[B, T]: which example of its row each token belongs to (the index of the example's
        first token); None for rows of one sequence each."""
        return self.documents

    def with_fields(self, rows: dict | None = None, tokens: dict | None = None) -> MicroBatch:
        """This micro-batch with more fields of the objective's own, per row and per token."""
        for name, t in (tokens or {}).items():
            if tuple(t.shape[:2]) != tuple(self.tokens.shape):
                raise ValueError(f"token field {name!r}: shape {tuple(t.shape)} does not start with the tokens' "
                                 f"{tuple(self.tokens.shape)}")
        for name, t in (rows or {}).items():
            if t.shape[0] != self.rows:
                raise ValueError(f"row field {name!r}: {t.shape[0]} rows, the micro-batch has {self.rows}")
        return replace(self, row_fields={**self.row_fields, **(rows or {})},
                       token_fields={**self.token_fields, **(tokens or {})})

    def to(self, device, non_blocking: bool = False) -> MicroBatch:
        move = (lambda t: t if t is None else t.to(device, non_blocking=non_blocking))
        return MicroBatch(move(self.tokens), move(self.targets), move(self.documents),
                          {k: move(v) for k, v in self.row_fields.items()},
                          {k: move(v) for k, v in self.token_fields.items()})

    def split(self, cp) -> MicroBatch:
        """This cp rank's tokens of every row (`cp`: a `ContextParallel`), and of every token
        field; the row fields whole. `documents` keep their values, indices into the whole row,
        so that attention across the split finds each example's start."""
        keep = cp.split
        return MicroBatch(keep(self.tokens), keep(self.targets), None if self.documents is None else keep(self.documents),
                          dict(self.row_fields), {k: keep(v) for k, v in self.token_fields.items()})

    def positions(self, index: torch.Tensor) -> torch.Tensor | None:
        """Each token's position in its example, given the tokens' indices in their rows (`index`:
        [T], a cp rank's global ones); None for unpacked rows (the model's own positions)."""
        return None if self.documents is None else index.to(self.documents.device) - self.documents


def micro_batches(tokens: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
                  micro_batch: int) -> list[MicroBatch]:
    """Rows of `seq_len + 1` tokens, their labels (the target of each token's predecessor) and
    where each token's example starts (None: one sequence a row), as micro-batches of
    `micro_batch` rows: the inputs are the first `seq_len` tokens, the targets the labels of the
    last `seq_len`."""
    docs = documents.split(micro_batch) if documents is not None else [None] * -(-tokens.shape[0] // micro_batch)
    return [MicroBatch(t[:, :-1], lab[:, 1:], None if d is None else d[:, :-1])
            for t, lab, d in zip(tokens.split(micro_batch), labels.split(micro_batch), docs)]
