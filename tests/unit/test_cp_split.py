"""Context parallelism's split, pure arithmetic: each rank holds chunks i and 2·cp−1−i of a
sequence, the ranks' tokens tile it once, and the causal work per rank is the same."""

from __future__ import annotations

import pytest
import torch

from rayzero.sharding.context_parallel import _pairs, positions, split, unsplit


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
            total += sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in _pairs(q, k, None, None, True, seq // (2 * cp)))
        work.append(total)
    c = seq // (2 * cp)
    assert work == [work[0]] * cp
    n = 2 * cp
    assert work[0] == c * c * n * (n + 1) // 2 // cp  # = c² (2·cp + 1), against c² · 4·cp without the skip
