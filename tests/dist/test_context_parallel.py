"""Context parallelism's attention on real gloo groups at cp 2 and 4: the ring (key/value blocks
passed point to point, merged by log-sum-exp, causal blocks skipped) and Ulysses (all-to-all to
a head split and back) each give every rank its tokens' rows of plain attention over the whole
sequence, and the gradients of its queries, keys and values, within 1e-5: causal; causal with
packed documents and padding; grouped-query attention (the ring with key/value heads that cp
does not divide)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayzero.sharding.comm import Axis
from rayzero.sharding.context_parallel import attention, positions, ring_attention, split, ulysses_attention
from tests.conftest import free_port
from tests.dist.pool import spawn

pytestmark = pytest.mark.slow
SEQ, BATCH, DIM = 32, 2, 8
# (name, query heads, key/value heads, with segments, modes)
CASES = [("causal", 4, 4, False, ("ring", "ulysses")),
         ("documents+padding", 4, 4, True, ("ring", "ulysses")),
         ("gqa", 8, 4, True, ("ring", "ulysses")),
         ("gqa-odd", 6, 2, False, ("ring",))]


def segments() -> torch.Tensor:
    """Row 0: three packed documents; row 1: one document, then 5 tokens of padding (-1)."""
    seg = torch.zeros(BATCH, SEQ, dtype=torch.long)
    seg[0, 9:20], seg[0, 20:] = 1, 2
    seg[1, SEQ - 5:] = -1
    return seg


def _run(rank: int, world: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    axis = Axis(dist.group.WORLD, world, rank)
    errors = {}
    try:
        for name, heads, kv_heads, with_seg, modes in CASES:
            g = torch.Generator().manual_seed(7)
            q, dout = (torch.randn(BATCH, heads, SEQ, DIM, generator=g) for _ in range(2))
            k, v = (torch.randn(BATCH, kv_heads, SEQ, DIM, generator=g) for _ in range(2))
            seg = segments() if with_seg else None
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            pos = torch.arange(SEQ)
            want = attention(*whole, pos, pos, seg, seg)
            (want * dout).sum().backward()
            mine = lambda t: split(t, world, rank, dim=2)  # noqa: E731
            for mode in modes:
                if mode == "ulysses" and (heads % world or kv_heads % world):
                    continue
                local = [mine(t).detach().requires_grad_() for t in (q, k, v)]
                fn = ring_attention if mode == "ring" else ulysses_attention
                got = fn(*local, axis, SEQ, None if seg is None else split(seg, world, rank, dim=1))
                (got * mine(dout)).sum().backward()
                pairs = [("out", got, mine(want))] + [(f"d{n}", t.grad, mine(w.grad))
                                                     for n, t, w in zip("qkv", local, whole)]
                errors[name, mode] = {n: float((a - b).detach().abs().max() / b.abs().max()) for n, a, b in pairs}
        out[rank] = {"errors": errors, "positions": positions(SEQ, world, rank).tolist()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_ulysses_equal_plain_attention_over_the_whole_sequence(cp):
    with mp.Manager() as manager:
        shared = manager.dict()
        spawn(_run, args=(cp, free_port(), shared), nprocs=cp)
        out = dict(shared)
    assert sorted(p for r in out for p in out[r]["positions"]) == list(range(SEQ))
    for r in range(cp):
        errors = out[r]["errors"]
        ran = {mode for _, mode in errors}
        assert ran == {"ring", "ulysses"}, ran
        for case, err in errors.items():
            assert max(err.values()) < 1e-5, (r, case, err)
