"""Context parallelism's split, pure arithmetic: each rank holds chunks i and 2·cp−1−i of a
sequence, the ranks' tokens tile it once, and the causal work per rank is the same; packed
examples' chunk pairs that never meet are skipped as the causal mask's are."""

from __future__ import annotations

import pytest
import torch

from rayzero.sharding.context_parallel import _pairs, _starts, positions, split, unsplit


def test_cp_2_of_8_tokens_worked_example():
    assert positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp,seq", [(1, 6), (2, 8), (2, 16), (4, 16), (4, 64)])
def test_the_ranks_tokens_tile_the_sequence_once_and_unsplit_restores_it(cp, seq):
    held = torch.cat([positions(seq, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))
    x = torch.randn(3, seq, 5)
    assert torch.equal(unsplit([split(x, cp, r) for r in range(cp)]), x)


def test_a_length_that_two_cp_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="2 x cp = 4"):
        positions(10, 2, 0)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_computes_the_same_causal_work_and_skips_hidden_blocks(cp):
    """Over the ring's cp steps each rank computes the same number of query-key pairs: of the
    2·cp chunks' pairs, those below the diagonal and the diagonal's (masked), 1/cp of them each;
    the pairs above the diagonal are skipped."""
    seq = 16 * cp
    work = []
    for r in range(cp):
        q = positions(seq, cp, r)
        total = 0
        for step in range(cp):
            k = positions(seq, cp, (r - step) % cp)
            total += sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in _pairs(q, k, None, True, seq // (2 * cp)))
        work.append(total)
    c = seq // (2 * cp)
    assert work == [work[0]] * cp
    n = 2 * cp
    assert work[0] == c * c * n * (n + 1) // 2 // cp  # = c² (2·cp + 1), against c² · 4·cp without the skip


def ring_pairs(cp: int, rank: int, seq: int, documents: torch.Tensor | None) -> list[tuple[int, int, str]]:
    """What rank `rank`'s ring computes over its cp steps: (query chunk's first position, key
    chunk's first position, how: full, diagonal or mask), documents given as the whole rows'."""
    chunk = seq // (2 * cp)
    q = positions(seq, cp, rank)
    local = None if documents is None else split(documents, cp, rank)
    out = []
    for step in range(cp):
        k = positions(seq, cp, (rank - step) % cp)
        for qs, ks, how in _pairs(q, k, local, True, chunk, starts=_starts(local, chunk)):
            out.append((int(q[qs][0]), int(k[ks][0]), how if isinstance(how, str) else "mask"))
    return sorted(out)


@pytest.mark.parametrize("cp", [2, 4])
def test_examples_that_never_meet_skip_their_blocks(cp):
    """Packed rows whose examples are each one chunk: every rank computes only its chunks against
    themselves, causal within (no mask built); one example over the whole row computes what no
    packing does; examples that cross chunk boundaries mask the pairs they share, and skip the
    rest."""
    seq, chunk = 16 * cp, 8
    every_chunk = (torch.arange(seq) // chunk * chunk)[None].repeat(2, 1)
    one = torch.zeros(2, seq, dtype=torch.long)
    for r in range(cp):
        mine = [int(p) for p in positions(seq, cp, r)[::chunk]]
        assert ring_pairs(cp, r, seq, every_chunk) == sorted((p, p, "diagonal") for p in mine)
        assert ring_pairs(cp, r, seq, one) == ring_pairs(cp, r, seq, None)
    # two examples in row 0 (the second starting mid-chunk), one in row 1: a pair is skipped only
    # where no row's queries reach its keys
    docs = torch.zeros(2, seq, dtype=torch.long)
    docs[0, 12:] = 12
    got = {(q, k): how for r in range(cp) for q, k, how in ring_pairs(cp, r, seq, docs)}
    assert got[(16, 0)] == "mask"  # row 1's queries see every key, row 0's none
    assert got[(8, 8)] == "mask"  # row 0's second example starts inside the chunk
    docs[1] = docs[0]
    got = {(q, k): how for r in range(cp) for q, k, how in ring_pairs(cp, r, seq, docs)}
    assert (16, 0) not in got  # keys before 12 meet no query of the second example
    assert got[(16, 8)] == "mask" and got[(24, 16)] == "full" and got[(0, 0)] == "diagonal"
