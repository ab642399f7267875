"""The flat-buffer layout: where each parameter lives and which part every data-parallel rank owns."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayzero.sharding.layout import Bucket, Layout, Range, ShardPiece, build_layout

FAST = settings(max_examples=200, deadline=None)

numels_st = st.lists(st.integers(1, 5000), min_size=1, max_size=40)
dp_st = st.integers(1, 8) | st.sampled_from([3, 5, 7])
bucket_st = st.integers(1, 20000) | st.integers(1, 64)
align_st = st.integers(1, 128) | st.sampled_from([1, 64, 128])


@st.composite
def layouts(draw):
    numels = draw(numels_st)
    dp = draw(dp_st)
    bucket_numel = draw(bucket_st)
    align = draw(align_st)
    return numels, dp, bucket_numel, align, build_layout(numels, dp, bucket_numel, align)


def all_pieces(layout: Layout) -> dict[int, list[ShardPiece]]:
    return {r: layout.shard_pieces(r) for r in range(layout.dp_size)}


# --------------------------------------------------------------------------- properties


@FAST
@given(layouts())
def test_params_are_contiguous_in_order_and_whole_in_one_bucket(case):
    numels, _, _, _, layout = case
    assert [p.index for p in layout.params] == list(range(len(numels)))
    assert [p.numel for p in layout.params] == numels
    for p in layout.params:
        assert p.world.size == p.numel
    # within a bucket, parameters follow one another with no gap; padding only at the bucket's end
    for b in layout.buckets:
        assert b.params, "a bucket holds at least one parameter"
        assert list(b.params) == list(range(b.params[0], b.params[-1] + 1))
        spans = [layout.params[i] for i in b.params]
        assert spans[0].world.start == b.world.start
        for a, c in zip(spans, spans[1:]):
            assert c.world.start == a.world.end
        assert spans[-1].world.end == b.data_end
        for s in spans:
            assert s.bucket == b.index
            assert b.world.start <= s.world.start and s.world.end <= b.data_end <= b.world.end
    # every parameter is in exactly one bucket, and the buckets keep the parameters' order
    assert [i for b in layout.buckets for i in b.params] == list(range(len(numels)))


@FAST
@given(layouts())
def test_buckets_tile_the_buffer_and_pad_to_the_shard_multiple(case):
    numels, dp, bucket_numel, align, layout = case
    multiple = dp * align
    assert [b.index for b in layout.buckets] == list(range(len(layout.buckets)))
    assert layout.buckets[0].world.start == 0
    for a, b in zip(layout.buckets, layout.buckets[1:]):
        assert b.world.start == a.world.end
    for b in layout.buckets:
        assert b.world.size % multiple == 0
        assert 0 <= b.world.end - b.data_end < multiple
    assert layout.numel == layout.buckets[-1].world.end == sum(b.world.size for b in layout.buckets)
    assert layout.shard_numel * dp == layout.numel
    assert layout.padding == layout.numel - sum(numels)
    assert layout.padding == sum(b.world.end - b.data_end for b in layout.buckets)


@FAST
@given(layouts())
def test_a_bucket_closes_as_soon_as_it_reaches_bucket_numel(case):
    _, _, bucket_numel, _, layout = case
    for b in layout.buckets:
        data = b.data_end - b.world.start
        last = layout.params[b.params[-1]].numel
        assert data - last < bucket_numel  # it was still open before its last parameter
        if b.index < len(layout.buckets) - 1:
            assert data >= bucket_numel  # only the final bucket may be short


@FAST
@given(layouts())
def test_every_rank_owns_an_equal_aligned_slice_of_every_bucket(case):
    _, dp, _, align, layout = case
    for b in layout.buckets:
        shards = [b.shard(r, dp) for r in range(dp)]
        assert {s.size for s in shards} == {b.shard_size(dp)}
        assert b.shard_size(dp) * dp == b.world.size
        assert shards[0].start == b.world.start and shards[-1].end == b.world.end
        for s, t in zip(shards, shards[1:]):
            assert t.start == s.end
        for s in shards:
            assert s.start % align == 0
    # each rank's shard is the concatenation of its slices, so every rank holds the same count
    offsets = [layout.local_offset(b.index) for b in layout.buckets]
    assert offsets[0] == 0
    for b, o, nxt in zip(layout.buckets, offsets, offsets[1:] + [layout.shard_numel]):
        assert nxt - o == b.shard_size(dp)
        assert o % align == 0


@FAST
@given(layouts())
def test_shard_pieces_cover_every_parameter_element_exactly_once(case):
    numels, dp, _, _, layout = case
    cover = [np.zeros(n, dtype=np.int64) for n in numels]
    world_cover = np.zeros(layout.numel, dtype=np.int64)
    for pieces in all_pieces(layout).values():
        for pc in pieces:
            assert pc.world.size > 0
            cover[pc.param][pc.param_range.slice()] += 1
            world_cover[pc.world.slice()] += 1
    for c in cover:
        assert (c == 1).all()
    # pieces touch exactly the data elements, never the padding
    expected = np.zeros(layout.numel, dtype=np.int64)
    for p in layout.params:
        expected[p.world.slice()] = 1
    assert np.array_equal(world_cover, expected)
    assert int(world_cover.sum()) == sum(numels) == layout.numel - layout.padding


@FAST
@given(layouts())
def test_the_four_coordinates_of_a_piece_agree(case):
    _, dp, _, _, layout = case
    for r, pieces in all_pieces(layout).items():
        for pc in pieces:
            span = layout.params[pc.param]
            bucket = layout.buckets[pc.bucket]
            shard = bucket.shard(r, dp)
            sizes = {pc.world.size, pc.world_in_bucket.size, pc.local.size, pc.param_range.size}
            assert len(sizes) == 1
            assert pc.bucket == span.bucket
            assert pc.world == pc.param_range.shift(span.world.start)
            assert pc.world_in_bucket == pc.world.shift(-bucket.world.start)
            assert pc.local == pc.world.shift(layout.local_offset(bucket.index) - shard.start)
            # the piece lies inside the rank's shard and inside the parameter
            assert shard.start <= pc.world.start and pc.world.end <= shard.end
            assert pc.param_range.end <= span.numel
            assert pc.world_in_bucket.end <= bucket.data_end - bucket.world.start


@FAST
@given(layouts())
def test_local_ranges_of_a_rank_tile_its_shard_except_for_padding(case):
    _, dp, _, _, layout = case
    for r, pieces in all_pieces(layout).items():
        local = np.zeros(layout.shard_numel, dtype=np.int64)
        for pc in pieces:
            local[pc.local.slice()] += 1
        assert local.max(initial=0) <= 1  # no overlap
        # pieces come in local order
        starts = [pc.local.start for pc in pieces]
        assert starts == sorted(starts)
        for a, b in zip(pieces, pieces[1:]):
            assert a.local.end <= b.local.start
        # uncovered local elements are exactly this rank's share of the buckets' padding
        padding_here = 0
        for b in layout.buckets:
            pad = Range(b.data_end, b.world.end)
            cut = pad.intersect(b.shard(r, dp))
            padding_here += cut.size if cut else 0
        assert int((local == 0).sum()) == padding_here
        assert sum(pc.local.size for pc in pieces) == layout.shard_numel - padding_here


@FAST
@given(layouts())
def test_world_in_bucket_is_the_same_on_every_rank_for_a_parameter(case):
    """Gathering every rank's pieces of a bucket rebuilds the bucket's data, in order."""
    _, dp, _, _, layout = case
    per_bucket: dict[int, list[ShardPiece]] = {}
    for r in range(dp):
        for pc in layout.shard_pieces(r):
            per_bucket.setdefault(pc.bucket, []).append(pc)
    for b in layout.buckets:
        pieces = sorted(per_bucket[b.index], key=lambda pc: pc.world_in_bucket.start)
        assert pieces[0].world_in_bucket.start == 0
        for a, c in zip(pieces, pieces[1:]):
            assert c.world_in_bucket.start == a.world_in_bucket.end
        assert pieces[-1].world_in_bucket.end == b.data_end - b.world.start


# --------------------------------------------------------------------------- worked examples


def test_three_params_over_three_ranks_worked_example():
    layout = build_layout([10, 7, 5], dp_size=3, bucket_numel=12, shard_align=1)
    # bucket 0 closes after param 1 (10 + 7 = 17 >= 12), padded to 18; param 2 alone, padded to 6
    assert layout.buckets == (
        Bucket(0, Range(0, 18), (0, 1), 17),
        Bucket(1, Range(18, 24), (2,), 23),
    )
    # param 2 starts after bucket 0's padding, not right after param 1
    assert [p.world for p in layout.params] == [Range(0, 10), Range(10, 17), Range(18, 23)]
    assert [p.bucket for p in layout.params] == [0, 0, 1]
    assert (layout.numel, layout.shard_numel, layout.padding) == (24, 8, 2)
    assert [layout.local_offset(i) for i in (0, 1)] == [0, 6]

    def piece(param, bucket, world, wib, local, prange):
        return ShardPiece(param, bucket, Range(*world), Range(*wib), Range(*local), Range(*prange))

    assert layout.shard_pieces(0) == [
        piece(0, 0, (0, 6), (0, 6), (0, 6), (0, 6)),
        piece(2, 1, (18, 20), (0, 2), (6, 8), (0, 2)),
    ]
    assert layout.shard_pieces(1) == [
        piece(0, 0, (6, 10), (6, 10), (0, 4), (6, 10)),
        piece(1, 0, (10, 12), (10, 12), (4, 6), (0, 2)),
        piece(2, 1, (20, 22), (2, 4), (6, 8), (2, 4)),
    ]
    assert layout.shard_pieces(2) == [
        piece(1, 0, (12, 17), (12, 17), (0, 5), (2, 7)),
        piece(2, 1, (22, 23), (4, 5), (6, 7), (4, 5)),
    ]


def test_alignment_pads_a_single_bucket_worked_example():
    layout = build_layout([3, 3], dp_size=2, bucket_numel=100, shard_align=4)
    assert layout.buckets == (Bucket(0, Range(0, 8), (0, 1), 6),)
    assert (layout.numel, layout.shard_numel, layout.padding) == (8, 4, 2)
    assert layout.shard_pieces(0) == [
        ShardPiece(0, 0, Range(0, 3), Range(0, 3), Range(0, 3), Range(0, 3)),
        ShardPiece(1, 0, Range(3, 4), Range(3, 4), Range(3, 4), Range(0, 1)),
    ]
    assert layout.shard_pieces(1) == [
        ShardPiece(1, 0, Range(4, 6), Range(4, 6), Range(0, 2), Range(1, 3)),
    ]


def test_bucket_numel_one_gives_every_param_its_own_bucket():
    layout = build_layout([5, 1, 4], dp_size=2, bucket_numel=1)
    assert [b.params for b in layout.buckets] == [(0,), (1,), (2,)]
    assert [b.world for b in layout.buckets] == [Range(0, 6), Range(6, 8), Range(8, 12)]
    assert layout.padding == 2


def test_a_rank_can_own_only_padding_of_a_bucket():
    # one element over four ranks: ranks 1..3 hold padding only and get no piece of it
    layout = build_layout([1], dp_size=4, bucket_numel=10)
    assert layout.numel == 4 and layout.shard_numel == 1 and layout.padding == 3
    assert layout.shard_pieces(0) == [ShardPiece(0, 0, Range(0, 1), Range(0, 1), Range(0, 1), Range(0, 1))]
    for r in (1, 2, 3):
        assert layout.shard_pieces(r) == []


def test_dp_size_one_owns_everything_and_needs_no_padding_without_alignment():
    layout = build_layout([7, 3, 9], dp_size=1, bucket_numel=8)
    assert layout.padding == 0 and layout.shard_numel == layout.numel == 19
    pieces = layout.shard_pieces(0)
    assert [(pc.param, pc.local, pc.param_range) for pc in pieces] == [
        (0, Range(0, 7), Range(0, 7)),
        (1, Range(7, 10), Range(0, 3)),
        (2, Range(10, 19), Range(0, 9)),
    ]


def test_no_parameters_gives_an_empty_layout():
    layout = build_layout([], dp_size=2, bucket_numel=4)
    assert layout.buckets == () and layout.numel == 0 and layout.shard_numel == 0
    assert layout.shard_pieces(0) == [] and layout.shard_pieces(1) == []


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "numels, dp, bucket_numel, align",
    [
        ([4, 4], 0, 8, 1),
        ([4, 4], -1, 8, 1),
        ([4, 0, 4], 2, 8, 1),
        ([4, -3], 2, 8, 1),
        ([4, 4], 2, 0, 1),
        ([4, 4], 2, 8, 0),
    ],
)
def test_invalid_arguments_raise_value_error(numels, dp, bucket_numel, align):
    with pytest.raises(ValueError):
        build_layout(numels, dp, bucket_numel, align)


@pytest.mark.parametrize("rank", [-1, 3, 100])
def test_shard_pieces_rejects_a_rank_outside_the_group(rank):
    layout = build_layout([10, 7, 5], dp_size=3, bucket_numel=12)
    with pytest.raises(ValueError, match="dp_rank"):
        layout.shard_pieces(rank)


def test_range_rejects_negative_or_reversed_bounds():
    with pytest.raises(ValueError):
        Range(-1, 3)
    with pytest.raises(ValueError):
        Range(5, 4)
    assert Range(3, 3).size == 0
    assert Range(0, 5).intersect(Range(5, 9)) is None
    assert Range(0, 5).intersect(Range(2, 9)) == Range(2, 5)


# -- sharding.bucket_numel=auto ---------------------------------------------------------

from rayzero.sharding.layout import (  # noqa: E402
    AUTO_BUCKETS, CAP, CAP_PER_RANK, FLOOR_PER_RANK, FLOOR_PER_RANK_CPU, auto_bucket_numel)


@FAST
@given(st.integers(1, 10**11), st.integers(1, 1024))
def test_auto_buckets_stay_between_the_floor_and_the_cap(numel, dp):
    b = auto_bucket_numel(numel, dp)
    cap = max(CAP, CAP_PER_RANK * dp)
    assert FLOOR_PER_RANK * dp <= b <= cap or b == cap  # the cap wins over the floor
    if FLOOR_PER_RANK * dp <= -(-numel // AUTO_BUCKETS) <= cap:  # in between: about 8 buckets
        assert len(build_layout([numel // 1000 + 1] * 1000, dp, b).buckets) in range(AUTO_BUCKETS - 1,
                                                                                    AUTO_BUCKETS + 2)


def test_auto_buckets_of_the_benchmark_models_at_two_ranks():
    # 0.45M, 3.3M, 10.8M parameters: every model gets several buckets (one fixed 4M bucket gave
    # the first two a single bucket, reduced only after backward)
    assert auto_bucket_numel(454_144, 2) == 2 * FLOOR_PER_RANK
    assert auto_bucket_numel(3_300_000, 2) == 412_500
    assert auto_bucket_numel(10_819_584, 2) == 1_352_448
    # large models keep the 4M of before, and Megatron's 1M elements per rank in large groups
    assert auto_bucket_numel(7 * 10**9, 4) == CAP == 2**22
    assert auto_bucket_numel(7 * 10**9, 64) == 64 * CAP_PER_RANK
    # a tiny model at many ranks: each rank's piece of a bucket stays at least the floor
    assert auto_bucket_numel(1000, 16) == 16 * FLOOR_PER_RANK


def test_auto_buckets_on_cpu_ranks_are_fewer_for_small_models_only():
    # gloo reduces on the cores the ranks compute on: a 0.45M model is one bucket at 2 ranks, a
    # 3.3M one four, and from 8M elements up (at 2 ranks) the buckets are GPU ranks' own
    assert auto_bucket_numel(454_144, 2, cpu=True) == 2 * FLOOR_PER_RANK_CPU == 2**20
    assert len(build_layout([454_144 // 100] * 100, 2, auto_bucket_numel(454_144, 2, cpu=True)).buckets) == 1
    assert len(build_layout([33_000] * 100, 2, auto_bucket_numel(3_300_000, 2, cpu=True)).buckets) == 4
    for numel, dp in ((10_819_584, 2), (7 * 10**9, 4), (7 * 10**9, 64)):
        assert auto_bucket_numel(numel, dp, cpu=True) == auto_bucket_numel(numel, dp)
    assert auto_bucket_numel(1000, 16, cpu=True) == 16 * FLOOR_PER_RANK_CPU


def test_a_strategy_on_cpu_builds_the_cpu_buckets():
    import torch

    from rayzero.sharding import Mesh, OptimConfig, ShardingConfig, Strategy, build_strategy

    model = torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(30)])  # 303,000 elements
    s = build_strategy("no_shard", model, Mesh(1), ShardingConfig(), OptimConfig())  # device "cpu"
    assert len(s.buffer.buckets) == 1
    assert len(Strategy.layout(model, ShardingConfig(), 1)[1].buckets) == 8  # what a GPU rank builds
