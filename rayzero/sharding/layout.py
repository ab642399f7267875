"""Pure arithmetic of the flat buffer: where each parameter lives and which rank owns what.

Megatron's distributed optimizer names four coordinates for a piece of a parameter that falls
into a rank's shard; they are kept here under the same names:

- ``world``:           offsets in the whole flat buffer (all buckets, padding included);
- ``world_in_bucket``: the same offsets relative to the start of the piece's bucket;
- ``local``:           offsets in this rank's shard (its slice of every bucket, concatenated);
- ``param``:           offsets in the parameter's own flattened elements.

No tensors here: a layout is computed from parameter sizes, so it can be tested for any
world size without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence


@dataclass(frozen=True)
class Range:
    """Half-open ``[start, end)``."""

    start: int
    end: int
    size: int = field(init=False, repr=False, compare=False)  # end - start

    def __post_init__(self):
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad range [{self.start}, {self.end})")
        object.__setattr__(self, "size", self.end - self.start)

    def shift(self, by: int) -> "Range":
        return Range(self.start + by, self.end + by)

    def intersect(self, other: "Range") -> "Range | None":
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def slice(self) -> slice:
        return slice(self.start, self.end)


@dataclass(frozen=True)
class ParamSpan:
    """One parameter's place in the flat buffer."""

    index: int
    numel: int
    world: Range
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters, padded so that it splits evenly across the data-parallel ranks."""

    index: int
    world: Range  # padded extent in the flat buffer
    params: tuple[int, ...]  # indices of the parameters it holds, in buffer order
    data_end: int  # world offset where the parameters end and padding begins

    def shard_size(self, dp_size: int) -> int:
        return self.world.size // dp_size

    def shard(self, dp_rank: int, dp_size: int) -> Range:
        """The slice of this bucket that `dp_rank` owns, in world coordinates."""
        size = self.shard_size(dp_size)
        return Range(self.world.start + dp_rank * size, self.world.start + (dp_rank + 1) * size)

    def local(self, r: Range) -> slice:
        """`r` (world coordinates, inside this bucket) as a slice of the bucket's own tensors."""
        return r.shift(-self.world.start).slice()


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls into one rank's shard of one bucket."""

    param: int
    bucket: int
    world: Range
    world_in_bucket: Range
    local: Range
    param_range: Range


@dataclass(frozen=True)
class Layout:
    params: tuple[ParamSpan, ...]
    buckets: tuple[Bucket, ...]
    dp_size: int

    @property
    def numel(self) -> int:
        """Total elements in the buffer, padding included."""
        return self.buckets[-1].world.end if self.buckets else 0

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns: the same on every rank."""
        return self.numel // self.dp_size

    @property
    def padding(self) -> int:
        return self.numel - sum(p.numel for p in self.params)

    def local_offset(self, bucket: int) -> int:
        """Where `bucket`'s shard starts inside a rank's local shard."""
        return self._local_offsets[bucket]

    @cached_property
    def _local_offsets(self) -> tuple[int, ...]:
        offsets, acc = [], 0
        for b in self.buckets:
            offsets.append(acc)
            acc += b.shard_size(self.dp_size)
        return tuple(offsets)

    def shard_pieces(self, dp_rank: int) -> list[ShardPiece]:
        """Every parameter piece in `dp_rank`'s shard, in local order."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {self.dp_size}")
        pieces = []
        for bucket in self.buckets:
            shard = bucket.shard(dp_rank, self.dp_size)
            to_local = self.local_offset(bucket.index) - shard.start
            for i in bucket.params:
                span = self.params[i]
                cut = span.world.intersect(shard)
                if cut is None:
                    continue
                pieces.append(
                    ShardPiece(
                        param=i,
                        bucket=bucket.index,
                        world=cut,
                        world_in_bucket=cut.shift(-bucket.world.start),
                        local=cut.shift(to_local),
                        param_range=cut.shift(-span.world.start),
                    )
                )
        return pieces


# `sharding.bucket_numel=auto`: about AUTO_BUCKETS buckets over the trainable parameters, so
# that the first ones are reduced while backward still runs even for a model of a few hundred
# thousand parameters (one fixed 4M-element bucket gave a small model a single bucket, reduced
# only after backward); each rank's shard of a bucket at least FLOOR_PER_RANK elements (a
# message smaller than that costs more in latency than it gains in overlap); and at most
# CAP elements, or CAP_PER_RANK per rank where the group is large (Megatron's rule: a bucket
# grows with the data-parallel size so every rank's shard stays large enough). On CPU ranks the
# floor is FLOOR_PER_RANK_CPU: gloo reduces on the cores the rank computes on, so a bucket's
# reduction during backward has no spare core to overlap on and each one costs its latency; a
# model under 8M elements at 2 ranks gets fewer, larger buckets there (one at 0.45M: 1.02x DDP's
# step instead of 1.08x at the median point of benchmarks/step_time.py's 0.5M grid).
AUTO_BUCKETS = 8
FLOOR_PER_RANK = 2**15
FLOOR_PER_RANK_CPU = 2**19
CAP = 2**22
CAP_PER_RANK = 2**20


def auto_bucket_numel(trainable_numel: int, dp_size: int, cpu: bool = False) -> int:
    """The bucket size `bucket_numel=auto` gives a model of this many trainable elements, on
    CPU ranks (gloo) with `cpu`."""
    cap = max(CAP, CAP_PER_RANK * dp_size)
    floor = (FLOOR_PER_RANK_CPU if cpu else FLOOR_PER_RANK) * dp_size
    return min(max(-(-trainable_numel // AUTO_BUCKETS), floor), cap)


def build_layout(
    numels: Sequence[int],
    dp_size: int,
    bucket_numel: int,
    shard_align: int = 1,
    groups: Sequence[int] | None = None,
) -> Layout:
    """Place parameters of the given sizes contiguously, in the given order, into buckets.

    A bucket is closed once it holds at least `bucket_numel` elements (a parameter is never
    split across buckets), then padded to a multiple of ``dp_size * shard_align`` so every
    rank's shard of it has the same size and starts `shard_align`-aligned. `groups` (one id
    per parameter, each id's parameters consecutive) also closes a bucket wherever the id
    changes: ZeRO-3 makes each FSDP unit a bucket of its own this way.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if bucket_numel < 1 or shard_align < 1:
        raise ValueError("bucket_numel and shard_align must be >= 1")
    if any(n < 1 for n in numels):
        raise ValueError("every parameter must have at least one element")
    if groups is not None:
        if len(groups) != len(numels):
            raise ValueError(f"{len(groups)} group ids for {len(numels)} parameters")
        changes = [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]]
        if len(changes) != len(set(changes)):
            raise ValueError("each group's parameters must be consecutive")
    multiple = dp_size * shard_align
    spans: list[ParamSpan] = []
    buckets: list[Bucket] = []
    start = offset = 0
    members: list[int] = []

    def close():
        nonlocal start, offset, members
        padded_end = start + -(-(offset - start) // multiple) * multiple
        buckets.append(Bucket(len(buckets), Range(start, padded_end), tuple(members), offset))
        start = offset = padded_end
        members = []

    for i, n in enumerate(numels):
        if members and groups is not None and groups[i] != groups[i - 1]:
            close()
        spans.append(ParamSpan(i, n, Range(offset, offset + n), len(buckets)))
        members.append(i)
        offset += n
        if offset - start >= bucket_numel:
            close()
    if members:
        close()
    return Layout(tuple(spans), tuple(buckets), dp_size)
