"""The dropout streams (`rayzero/sharding/rng.py`) and the vocabulary's padded split, pure: what a
micro-batch draws is a function of (seed, step, micro-batch, TP rank, region) only; a
recompute replays it; a vocabulary the TP size does not divide is padded, the padding mapped to
nothing."""

import pytest
import torch

from rayzero.sharding.flat_buffer import FillSource
from rayzero.sharding.rng import REGIONS, RandomStreams, stream_seed
from rayzero.sharding.tensor_parallel import Split, TPLayout, TPSlices


def draws(streams: RandomStreams, regions=("replicated", "tp", "sequence", "replicated")) -> list[torch.Tensor]:
    out = []
    for region in regions:
        streams.enter(region)
        out.append(torch.rand(4))
    return out


def test_a_micro_batch_draws_the_same_whatever_was_drawn_before():
    a, b = RandomStreams(seed=3), RandomStreams(seed=3)
    a.begin(step=5, micro=2)
    first = draws(a)
    torch.rand(1000)  # setup, evaluation, a restart: anything drawn in between
    b.begin(step=5, micro=2)
    assert all(torch.equal(x, y) for x, y in zip(first, draws(b)))


def test_streams_differ_by_step_micro_batch_seed_and_region():
    def first(seed=3, step=5, micro=2, region="replicated"):
        s = RandomStreams(seed)
        s.begin(step, micro)
        s.enter(region)
        return torch.rand(8)

    base = first()
    for other in (first(seed=4), first(step=6), first(micro=3), first(region="tp"), first(region="sequence")):
        assert not torch.equal(base, other)
    assert not torch.equal(first(region="tp"), first(region="sequence"))


def test_tp_ranks_share_the_replicated_stream_and_own_the_others():
    ranks = [RandomStreams(seed=1, tp_rank=t) for t in range(4)]
    got = []
    for s in ranks:
        s.begin(step=0, micro=0)
        got.append({region: (s.enter(region), torch.rand(8))[1] for region in ("replicated", "tp", "sequence")})
    assert all(torch.equal(g["replicated"], got[0]["replicated"]) for g in got)
    for region in ("tp", "sequence"):
        assert len({tuple(g[region].tolist()) for g in got}) == 4, region


def test_cp_ranks_draw_streams_of_their_own_in_every_region():
    """The ranks of a cp group hold different tokens: every stream differs between them, the
    replicated one too; without cp (cp_rank None) the streams are what they were."""
    def first_draws(**kw):
        s = RandomStreams(seed=1, tp_rank=1, **kw)
        s.begin(step=2, micro=3)
        return {region: (s.enter(region), torch.rand(8))[1] for region in REGIONS}

    plain, cp0, cp1 = first_draws(), first_draws(cp_rank=0), first_draws(cp_rank=1)
    for region in REGIONS:
        assert not torch.equal(cp0[region], cp1[region]), region
        assert not torch.equal(cp0[region], plain[region]), region
    old = torch.Generator().manual_seed(stream_seed(1, "replicated", 2, 3)).get_state()
    assert torch.equal(plain["replicated"], (torch.set_rng_state(old), torch.rand(8))[1])


def test_a_region_resumes_its_stream_where_it_stopped():
    """Leaving a stream and coming back continues it: the draws of each region are those of
    its stream alone, however the regions interleave."""
    a, b = RandomStreams(seed=0), RandomStreams(seed=0)  # one after the other: they share torch's generator
    a.begin(1, 1)
    interleaved = draws(a, ("replicated", "tp", "replicated", "tp"))
    b.begin(1, 1)
    in_order = draws(b, ("replicated", "replicated", "tp", "tp"))
    assert torch.equal(interleaved[0], in_order[0]) and torch.equal(interleaved[2], in_order[1])
    assert torch.equal(interleaved[1], in_order[2]) and torch.equal(interleaved[3], in_order[3])


def test_restoring_a_state_replays_every_stream():
    s = RandomStreams(seed=9, tp_rank=1)
    s.begin(2, 0)
    s.enter("tp")
    torch.rand(3)
    before = s.state()
    first = draws(s)
    s.restore(before)
    assert all(torch.equal(x, y) for x, y in zip(first, draws(s)))


def test_before_the_first_micro_batch_nothing_is_touched():
    s = RandomStreams(seed=0)
    state = torch.get_rng_state()
    s.enter("tp")
    with s.region("sequence"):
        pass
    assert s.state() is None and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("rows, tp", [(7, 2), (259, 4), (5, 4), (8, 4)])
def test_a_padded_vocabulary_split_maps_the_padding_to_nothing(rows, tp):
    """Each rank holds ceil(V / tp) rows; its real rows are read from the whole tensor, the
    padding is zero, and the real rows of all ranks tile the whole exactly once."""
    shape, split = (rows, 3), Split(0, padded=True)
    local_rows = -(-rows // tp)
    assert split.local_shape(shape, tp) == (local_rows, 3)
    whole = torch.arange(rows * 3, dtype=torch.float32).view(shape) + 1
    source = FillSource(lambda name, out: out.copy_(whole))
    seen = []
    for r in range(tp):
        local = torch.full((local_rows, 3), float("nan"))
        TPSlices(source, TPLayout(tp, r, {"w": split}, {"w": shape})).fill("w", local)
        real = max(0, min(local_rows, rows - r * local_rows))
        assert torch.equal(local[:real], whole[r * local_rows: r * local_rows + real])
        assert torch.equal(local[real:], torch.zeros(local_rows - real, 3)), "padding rows start at zero"
        seen += [g for _, g, n in split.runs(shape, tp, r) for g in range(g, g + n)]
    assert sorted(seen) == list(range(rows * 3))
    layout = TPLayout(tp, 0, {"w": split}, {"w": shape})
    assert layout.split_numel() == rows * 3 - local_rows * 3, "the whole model = a rank's share + the others'"
    assert Split.from_record(split.record()) == split
