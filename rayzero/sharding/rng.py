"""One definition of a rank's random stream in training, as Megatron's RNG tracker has it.

Dropout draws from torch's default generator (the CPU's, or the rank's GPU's). `RandomStreams`
decides what that generator holds while a micro-batch's forward runs:

    replicated   activations every rank of a TP group holds alike (the embeddings' output, the
                 residual stream without sequence parallelism): the same masks on every TP rank
    sequence     with sequence parallelism, the residual stream's sequence shards: a stream of
                 each TP rank's own
    tp           a TP group's split regions (a rank's attention heads, its share of the MLP's
                 width, from a column-parallel output to the row-parallel layer after it): a
                 stream of each TP rank's own

`begin(step, micro)` seeds all three at the start of each micro-batch's forward from
(`train.seed`, step, the global micro-batch index, and for the two per-rank streams the TP rank),
so nothing drawn before it (setup, evaluation, the activation measurement, a restart) can shift
what training draws. The global micro-batch index is where the micro-batch's rows sit in the
step's global batch (data-parallel rank x micro-batches per rank + its index on the rank): a
function of the samples, not of the world size, so data-parallel ranks draw distinct streams and a
run resumed at another data-parallel size draws the masks the unbroken run drew for the same rows.

With context parallelism every activation is split over the cp group's ranks (each holds its
part of every sequence), so every stream also takes the rank's cp coordinate: the ranks of a cp
group draw distinct masks for their distinct tokens (Megatron's per-cp-rank seed offset). At cp 1
the seeds are what they were without it.

The tensor-parallel layers call `enter` at their boundaries (`tensor_parallel.parallelize`);
activation checkpointing takes `state()` before a block's forward and `restore`s it before the
recompute, so the recompute replays exactly the first forward's masks in every stream.

Pure torch (no Ray).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch

REGIONS = ("replicated", "sequence", "tp")


def stream_seed(*parts) -> int:
    """A 64-bit seed from its parts (a CPU generator keeps the low 32 bits)."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


class RandomStreams:
    """The rank's dropout streams; see the module docstring. Until the first `begin` (on the
    driver, or before training) every call is a no-op and the generator is left alone."""

    def __init__(self, seed: int, tp_rank: int = 0, device: torch.device | str = "cpu", cp_rank: int | None = None):
        self.seed, self.tp_rank = seed, tp_rank
        self.cp = () if cp_rank is None else ("cp", cp_rank)  # in every seed, with context parallelism
        self.device = torch.device(device)
        self.active: str | None = None  # the region whose stream the generator holds now
        # the other regions' streams: where they stopped, or their seed until first entered
        self._saved: dict[str, torch.Tensor | int] = {}

    # -- the generator itself ----------------------------------------------------------------
    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _seeded(self, seed: int) -> torch.Tensor:
        return torch.Generator(device=self.device).manual_seed(seed).get_state()

    # -- per micro-batch ---------------------------------------------------------------------
    def begin(self, step: int, micro: int, stage: int = 0) -> None:
        """Seed every stream for micro-batch `micro` (its global index) of step `step`, in
        pipeline stage `stage` (each stage draws its own, as Megatron offsets its seed per
        stage); the generator then holds the replicated stream. A stream's state is made when
        it is first entered: without tensor parallelism only the replicated one ever is."""
        at = ((step, micro) if stage == 0 else (step, micro, "stage", stage)) + self.cp
        self._saved = {"replicated": stream_seed(self.seed, "replicated", *at),
                       "sequence": stream_seed(self.seed, "sequence", *at, self.tp_rank),
                       "tp": stream_seed(self.seed, "tp", *at, self.tp_rank)}
        self.active = None
        self.enter("replicated")

    def enter(self, region: str) -> None:
        """Draw from `region`'s stream from here on: the active stream is kept where it stopped."""
        if self.active is None and not self._saved or region == self.active:
            return
        if self.active is not None:
            self._saved[self.active] = self._get()
        state = self._saved.pop(region)
        self._set(state if isinstance(state, torch.Tensor) else self._seeded(state))
        self.active = region

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """`name`'s stream inside the block, the one before it after."""
        before = self.active
        self.enter(name)
        try:
            yield
        finally:
            if before is not None:
                self.enter(before)

    # -- replay, for a recompute -------------------------------------------------------------
    def state(self) -> tuple | None:
        """Every stream where it stands now (None before the first `begin`)."""
        if self.active is None:
            return None
        return self.active, self._get(), dict(self._saved)

    def restore(self, state: tuple | None) -> None:
        """Every stream back to `state()`: what follows draws what followed then."""
        if state is None:
            return
        self.active, live, saved = state
        self._saved = dict(saved)
        self._set(live)
