"""Context parallelism's attention on real gloo groups at cp 2 and 4: the ring (key/value blocks
passed point to point, merged by log-sum-exp, causal blocks skipped) and Ulysses (all-to-all to
a head split and back) each give every rank its tokens' rows of plain attention over the whole
sequence, and the gradients of its queries, keys and values, within 1e-5: causal; causal with
packed documents and padding; grouped-query attention (the ring with key/value heads that cp
does not divide); and the ring with attention dropout, against plain attention whose
probabilities take the same masks (each chunk pair's, drawn again from its seed); a mixture of
experts' load-balancing loss (carrying a router z-loss's gradient) over the cp group's tokens against transformers' over the whole
sequences, with its gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayzero.sharding.comm import Axis
from rayzero.sharding.context_parallel import (Dropout, RingAttention, _expand, attention, positions, ring_attention,
                                              split, ulysses_attention)
from tests.conftest import free_port
from tests.dist.pool import spawn

pytestmark = pytest.mark.slow
SEQ, BATCH, DIM = 32, 2, 8
# (name, query heads, key/value heads, with packed documents, modes)
CASES = [("causal", 4, 4, False, ("ring", "ulysses")),
         ("documents+padding", 4, 4, True, ("ring", "ulysses")),
         ("gqa", 8, 4, True, ("ring", "ulysses")),
         ("gqa-odd", 6, 2, False, ("ring",))]


def documents() -> torch.Tensor:
    """Where each token's example starts. Row 0: three packed documents; row 1: one document,
    then 5 tokens of padding (an example of its own)."""
    docs = torch.zeros(BATCH, SEQ, dtype=torch.long)
    docs[0, 9:20], docs[0, 20:] = 9, 20
    docs[1, SEQ - 5:] = SEQ - 5
    return docs


def dropped_attention(q, k, v, drop: Dropout, cp: int) -> torch.Tensor:
    """Causal attention over the whole sequence with the ring's masks: chunk pair (i, j) of the
    2·cp chunks keeps what `drop.keep` gives at positions (i·c, j·c)."""
    c = SEQ // (2 * cp)
    keep = torch.cat([torch.cat([drop.keep((BATCH, q.shape[1], c, c), [i * c], [j * c], q.device)
                                 for j in range(2 * cp)], dim=-1) for i in range(2 * cp)], dim=-2)
    groups = q.shape[1] // k.shape[1]
    s = (q @ _expand(k, groups).transpose(-1, -2)) / DIM ** 0.5
    s = s.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) * keep) @ _expand(v, groups)


def _dropout_case(rank: int, world: int, axis: Axis) -> dict:
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(BATCH, 4, SEQ, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(BATCH, 2, SEQ, DIM, generator=g) for _ in range(2))
    drop = Dropout(0.3, seed=1234)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = dropped_attention(*whole, drop, world)
    (want * dout).sum().backward()
    mine = lambda t: split(t, world, rank, dim=2)  # noqa: E731
    local = [mine(t).detach().requires_grad_() for t in (q, k, v)]
    got = RingAttention.apply(*local, None, axis, SEQ, True, 1 / DIM ** 0.5, drop)
    (got * mine(dout)).sum().backward()
    pairs = [("out", got, mine(want))] + [(f"d{n}", t.grad, mine(w.grad)) for n, t, w in zip("qkv", local, whole)]
    dropped = float((got - ring_attention(*(t.detach() for t in local), axis, SEQ)).abs().max())
    return {**{n: float((a - b).detach().abs().max() / b.abs().max()) for n, a, b in pairs}, "changed": dropped}


def _balancing_case(rank: int, world: int, axis: Axis) -> dict:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from rayzero.models.routers import Balance

    g = torch.Generator().manual_seed(5)
    layers = [torch.randn(BATCH * SEQ, 8, generator=g) for _ in range(3)]  # 3 layers' router logits, 8 experts
    whole = [t.clone().requires_grad_() for t in layers]
    want = load_balancing_loss_func(tuple(whole), 8, 2, None)
    # with a router z-loss at 0.5 x the balance's weight: ST-MoE's, each layer's mean of logsumexp^2
    (want + 0.5 * sum(torch.logsumexp(t, -1).square().mean() for t in whole)).backward()
    mine = lambda t: split(t.view(BATCH, SEQ, 8), world, rank).reshape(-1, 8)  # noqa: E731
    local = [mine(t).detach().requires_grad_() for t in layers]
    balance = Balance((axis,), 8, 2, z=0.5)
    got = balance.loss(local)  # the value: the balance alone
    got.backward()
    z = float(sum(torch.logsumexp(t, -1).square().mean() for t in layers))  # the z-loss, reported apart
    z_error = abs(balance.take_z() - z) / z
    grads = max(float((a.grad - mine(b.grad)).abs().max() / b.grad.abs().max()) for a, b in zip(local, whole))
    return {"loss": abs(float(got) - float(want)) / float(want), "grad": grads, "z": z_error}


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
            docs = documents() if with_seg else None
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            pos = torch.arange(SEQ)
            want = attention(*whole, pos, pos, docs)
            (want * dout).sum().backward()
            mine = lambda t: split(t, world, rank, dim=2)  # noqa: E731
            for mode in modes:
                if mode == "ulysses" and (heads % world or kv_heads % world):
                    continue
                local = [mine(t).detach().requires_grad_() for t in (q, k, v)]
                fn = ring_attention if mode == "ring" else ulysses_attention
                got = fn(*local, axis, SEQ, None if docs is None else split(docs, world, rank, dim=1))
                (got * mine(dout)).sum().backward()
                pairs = [("out", got, mine(want))] + [(f"d{n}", t.grad, mine(w.grad))
                                                     for n, t, w in zip("qkv", local, whole)]
                errors[name, mode] = {n: float((a - b).detach().abs().max() / b.abs().max()) for n, a, b in pairs}
        out[rank] = {"errors": errors, "positions": positions(SEQ, world, rank).tolist(),
                     "dropout": _dropout_case(rank, world, axis), "balancing": _balancing_case(rank, world, axis)}
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
        assert max(out[r]["balancing"].values()) < 1e-6, out[r]["balancing"]
        dropout = out[r]["dropout"]
        assert dropout.pop("changed") > 0.1, "the masks dropped nothing"
        assert max(dropout.values()) < 1e-5, (r, dropout)
