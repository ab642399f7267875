"""Rollouts in training (`train.objective=grpo`): a step's rows are not read from the dataset but
made by the driver from the round's completions (`cluster/rollouts.py`) and handed to every rank
with the step's plan (`plan["rollout"]`). A row is one prompt and one of its completions:

    tokens    prompt + completion, minus the last token, padded to seq_len with PAD
    targets   the next token, IGNORE_INDEX except on the completion's tokens (all IGNORE_INDEX for
              a completion `grpo.mask_truncated_completions` leaves out)
    advantage its completion's advantage (a row field)
    length    its completion tokens that count, in the whole row (a row field: with context
              parallelism a rank holds part of the row, and a per-sequence mean needs the whole)
    sampler   the sampler's log-probability of each completion token, where the targets are (a
              token field, `sampler_logps`; NaN elsewhere), when every row of the step has them

The step's rows are in the order the driver gives (prompt by prompt, each prompt's completions by
their index); rank r of d takes rows [r·B/d, (r+1)·B/d), split into micro-batches: the same rows
at any world size, as every other kind of data.

A step may bring fewer rows than the global batch (dynamic sampling's round still short): they
are padded with rows that take no part in the loss up to whole micro-batches on every rank (up
to the whole batch with pipeline stages, whose schedule is fixed), so the step runs fewer
micro-batches, the same number on every rank, and the iteration's phases past them do nothing.
"""

from __future__ import annotations

import torch

from rayzero.data.microbatch import MicroBatch
from rayzero.sharding.vocab_parallel import IGNORE_INDEX

PAD = 0  # after a row's last token: a causal model's real tokens never attend to it


def rollout_rows(rows: list[dict], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N, seq_len], targets [N, seq_len], advantages [N]) of rollout rows, each
    {"ids": prompt + completion ids, "start": where the completion begins, "advantage",
    "masked": whether it takes no part in the loss, "logps": the sampler's (optional)}."""
    n = len(rows)
    tokens = torch.full((n, seq_len), PAD, dtype=torch.long)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, r in enumerate(rows):
        ids = torch.tensor(r["ids"], dtype=torch.long)
        if len(ids) > seq_len + 1:
            raise ValueError(f"a rollout of {len(ids)} tokens does not fit train.seq_len={seq_len} + 1")
        tokens[i, : len(ids) - 1] = ids[:-1]
        if not r.get("masked"):
            start = int(r["start"])  # the first completion token's target sits at start - 1
            targets[i, start - 1: len(ids) - 1] = ids[start:]
    advantages = torch.tensor([float(r["advantage"]) for r in rows], dtype=torch.float32)
    return tokens, targets, advantages


def sampler_logps(rows: list[dict], seq_len: int) -> torch.Tensor | None:
    """The sampler's log-probability of each completion token [N, seq_len], where its target is
    (NaN elsewhere), or None unless every row has them."""
    if not rows or any(r.get("logps") is None or any(x is None for x in r["logps"]) for r in rows):
        return None
    out = torch.full((len(rows), seq_len), float("nan"), dtype=torch.float32)
    for i, r in enumerate(rows):
        start = int(r["start"])
        out[i, start - 1: start - 1 + len(r["logps"])] = torch.tensor(r["logps"], dtype=torch.float32)
    return out


class RolloutBatches:
    """One data-parallel rank's slice of each step's rollouts, in micro-batches. Made as the
    other kinds' batches are (`data/kinds.py`); the dataset's prompts are the driver's to read."""

    masks_labels = True
    pairs = False

    def __init__(self, dataset, *, seed: int, global_batch: int, micro_batch: int, seq_len: int, dp_rank: int,
                 dp_size: int):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not divisible by micro batch {micro_batch} "
                             f"x data-parallel size {dp_size}")
        self.global_batch, self.micro_batch, self.seq_len = global_batch, micro_batch, seq_len
        self.dp_rank, self.dp_size, self.rows_per_rank = dp_rank, dp_size, global_batch // dp_size
        self.whole_steps = False  # every step its whole batch (pipeline stages: a fixed schedule)
        self._given: dict | None = None  # the plan's rollouts: {"step", "rows"}

    @property
    def num_microbatches(self) -> int:
        return self.rows_per_rank // self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def take(self, rollout: dict) -> None:
        """The step's rollouts, from its plan: {"step", "rows": every row of the step}, as many as
        the global batch or fewer (padded here with rows that take no part)."""
        rows, unit = rollout["rows"], self.micro_batch * self.dp_size
        if not 0 < len(rows) <= self.global_batch:
            raise ValueError(f"step {rollout['step']}: {len(rows)} rollouts for a global batch of "
                             f"{self.global_batch}")
        want = self.global_batch if self.whole_steps else -(-len(rows) // unit) * unit
        pad = {**rows[-1], "masked": True, "advantage": 0.0, "padding": True}
        self._given = {**rollout, "rows": list(rows) + [pad] * (want - len(rows))}

    def microbatches(self, step: int) -> list[MicroBatch]:
        given = self._given
        if given is None or given["step"] != step:
            raise RuntimeError(f"step {step}: its plan brought no rollouts")
        per = len(given["rows"]) // self.dp_size
        mine = given["rows"][self.dp_rank * per:(self.dp_rank + 1) * per]
        tokens, targets, adv = rollout_rows(mine, self.seq_len)
        m = self.micro_batch
        length = (targets != IGNORE_INDEX).sum(-1).double()
        sampler = sampler_logps(mine, self.seq_len)
        padded = any(r.get("padding") for r in given["rows"])  # rows that are not the step's: counted nowhere
        padding = torch.tensor([bool(r.get("padding")) for r in mine])
        return [MicroBatch(t, y, row_fields={"advantage": a, "length": n, **({"padding": p} if padded else {})},
                           token_fields={"sampler_logps": sampler[k:k + m]} if sampler is not None else {})
                for k, t, y, a, n, p in zip(range(0, len(mine), m), tokens.split(m), targets.split(m), adv.split(m),
                                            length.split(m), padding.split(m))]

    def close(self) -> None:
        self._given = None
