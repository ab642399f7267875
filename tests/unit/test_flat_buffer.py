"""The flat parameter/gradient buffer, its per-bucket backward callbacks, and AdamW over flat shards."""

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rayzero.models.gpt import ModelConfig, build_model
from rayzero.sharding.adamw import AdamWHyper, FlatAdamW, merge_runs
from rayzero.sharding.flat_buffer import FlatBuffer
from rayzero.sharding.layout import Range

FAST = settings(max_examples=60, deadline=None)

CFG = ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=40)
BLOCK = 8


def tiny_gpt():
    return build_model(CFG, BLOCK, seed=0)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (3, BLOCK), generator=g)
    tgt = torch.randint(0, CFG.vocab_size, (3, BLOCK), generator=g)
    return idx, tgt


def loss_of(model, seed: int) -> torch.Tensor:
    idx, tgt = batch(seed)
    return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())


def reference_grads(seeds) -> dict[str, torch.Tensor]:
    """Gradients of a plain copy of the model, accumulated over one backward per seed."""
    ref = tiny_gpt()
    for s in seeds:
        loss_of(ref, s).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def flat_gpt(dp_size=3, bucket_numel=500, shard_align=4):
    model = tiny_gpt()
    buf = FlatBuffer(list(model.named_parameters()), dp_size, bucket_numel, shard_align)
    return model, buf


def param_region(buf: FlatBuffer, data: torch.Tensor, i: int) -> torch.Tensor:
    return data[buf.layout.params[i].world.slice()]


def padding_mask(buf: FlatBuffer) -> torch.Tensor:
    mask = torch.ones(buf.layout.numel, dtype=torch.bool)
    for span in buf.layout.params:
        mask[span.world.slice()] = False
    return mask


# --------------------------------------------------------------------------- layout of the storage


def test_params_and_grads_are_views_into_the_flat_buffers():
    model, buf = flat_gpt()
    assert len(buf.buckets) > 2 and buf.layout.padding > 0  # the case is not trivial
    size = buf.param_data.element_size()
    for p, span in zip(buf.params, buf.layout.params):
        assert p.data.data_ptr() == buf.param_data.data_ptr() + span.world.start * size
        assert p.grad.data_ptr() == buf.grad_data.data_ptr() + span.world.start * size
        assert p.data.is_contiguous() and p.grad.shape == p.shape
        assert p.data.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
    assert buf.param_data.numel() == buf.grad_data.numel() == buf.layout.numel


def test_writing_the_buffer_changes_the_parameters():
    model, buf = flat_gpt()
    for i, p in enumerate(buf.params):
        param_region(buf, buf.param_data, i).fill_(float(i + 1))
        assert (p.detach() == i + 1).all()
        param_region(buf, buf.grad_data, i).fill_(-float(i + 1))
        assert (p.grad == -(i + 1)).all()


def test_values_are_preserved_and_the_forward_is_unchanged():
    model, buf = flat_gpt()
    ref = tiny_gpt()
    ref_params = dict(ref.named_parameters())
    for name, p in buf.named_params:
        assert torch.equal(p.detach(), ref_params[name].detach()), name
    assert model.lm_head.weight is model.wte.weight  # the tie survives
    assert not padding_mask(buf).logical_and(buf.param_data != 0).any()
    idx, _ = batch(0)
    with torch.no_grad():
        assert torch.equal(model(idx), ref(idx))


def test_buffer_order_is_the_reverse_of_named_parameters():
    model, buf = flat_gpt()
    named = list(model.named_parameters())
    assert buf.names == [n for n, _ in reversed(named)]
    assert all(a is b for a, b in zip(buf.params, [p for _, p in reversed(named)]))
    assert "lm_head.weight" not in buf.names  # the tied weight is stored once
    starts = [s.world.start for s in buf.layout.params]
    assert starts == sorted(starts)
    assert buf.layout.params[-1].world.size == model.wte.weight.numel()
    sd = buf.state_dict()
    assert list(sd) == buf.names
    assert all(torch.equal(sd[n], p.detach()) for n, p in model.named_parameters())


def test_backward_accumulates_into_the_gradient_buffer():
    model, buf = flat_gpt()
    loss_of(model, 1).backward()
    loss_of(model, 2).backward()
    expected = reference_grads([1, 2])
    for i, name in enumerate(buf.names):
        torch.testing.assert_close(param_region(buf, buf.grad_data, i).view_as(expected[name]), expected[name])
        assert buf.params[i].grad.data_ptr() == param_region(buf, buf.grad_data, i).data_ptr()
    assert (buf.grad_data[padding_mask(buf)] == 0).all()


def test_zero_grads_zeroes_and_the_next_backward_still_lands_in_the_buffer():
    model, buf = flat_gpt()
    loss_of(model, 1).backward()
    assert buf.grad_data.abs().sum() > 0
    buf.zero_grads()
    assert (buf.grad_data == 0).all()
    assert all((p.grad == 0).all() for p in buf.params)
    loss_of(model, 3).backward()
    expected = reference_grads([3])
    for i, name in enumerate(buf.names):
        torch.testing.assert_close(buf.params[i].grad, expected[name])
        torch.testing.assert_close(param_region(buf, buf.grad_data, i).view_as(expected[name]), expected[name])


def test_mixed_dtypes_are_refused():
    mixed = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double())
    with pytest.raises(ValueError, match="one dtype"):
        FlatBuffer(list(mixed.named_parameters()), dp_size=1, bucket_numel=8)


# --------------------------------------------------------------------------- per-bucket callbacks


@pytest.mark.parametrize("dp_size,bucket_numel,align", [(3, 500, 4), (2, 1, 1), (4, 2000, 8), (1, 10**6, 1)])
def test_each_bucket_fires_once_with_its_final_gradients(dp_size, bucket_numel, align):
    model, buf = flat_gpt(dp_size, bucket_numel, align)
    expected = reference_grads([5])
    pad = padding_mask(buf)
    fired = []
    seen_at_fire = []

    def on_ready(bucket):
        fired.append(bucket.index)
        for i in bucket.params:
            got = param_region(buf, buf.grad_data, i)
            torch.testing.assert_close(got, expected[buf.names[i]].flatten(), msg=buf.names[i])
        assert (buf.bucket_grads(bucket)[pad[bucket.world.slice()]] == 0).all()
        assert buf.bucket_grads(bucket).data_ptr() == buf.grad_data[bucket.world.start :].data_ptr()
        seen_at_fire.append(buf.grad_data.clone())

    buf.arm(on_ready)
    loss_of(model, 5).backward()
    assert sorted(fired) == list(range(len(buf.buckets)))
    assert buf.unfired() == []
    if len(buf.buckets) > 1:
        # callbacks run during backward: when the first fires, the embedding's gradient
        # (the last to be completed, in the last bucket) is still zero
        wte = buf.names.index("wte.weight")
        assert buf.layout.params[wte].bucket == len(buf.buckets) - 1
        assert (param_region(buf, seen_at_fire[0], wte) == 0).all()
        assert fired[-1] == len(buf.buckets) - 1


def test_disarmed_backward_fires_nothing():
    model, buf = flat_gpt(bucket_numel=1)
    fired = []
    buf.arm(None)
    loss_of(model, 1).backward()
    assert fired == [] and buf.unfired() == []

    buf.arm(fired.append)
    buf.disarm()
    loss_of(model, 2).backward()
    assert fired == [] and buf.unfired() == []
    # the gradients still accumulated
    torch.testing.assert_close(buf.params[-1].grad, reference_grads([1, 2])["wte.weight"])


def test_arming_covers_only_the_next_backward():
    model, buf = flat_gpt()
    fired = []
    buf.arm(lambda b: fired.append(b.index))
    loss_of(model, 1).backward()
    assert sorted(fired) == list(range(len(buf.buckets)))
    fired.clear()
    buf.arm(None)
    loss_of(model, 2).backward()
    assert fired == []
    buf.arm(lambda b: fired.append(b.index))  # re-arming counts afresh
    loss_of(model, 3).backward()
    assert sorted(fired) == list(range(len(buf.buckets)))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.unused = nn.Linear(4, 3)
        self.b = nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("bucket_numel", [1, 12, 10**6])
def test_unfired_lists_the_buckets_of_params_without_gradient(bucket_numel):
    torch.manual_seed(0)
    model = WithUnused()
    buf = FlatBuffer(list(model.named_parameters()), dp_size=2, bucket_numel=bucket_numel)
    fired = []
    buf.arm(lambda b: fired.append(b.index))
    model(torch.randn(6, 4)).pow(2).sum().backward()
    unused = {buf.layout.params[i].bucket for i, n in enumerate(buf.names) if n.startswith("unused.")}
    assert unused
    assert sorted(b.index for b in buf.unfired()) == sorted(unused)
    assert sorted(fired) == sorted(set(range(len(buf.buckets))) - unused)
    assert len(fired) == len(set(fired))
    for i, n in enumerate(buf.names):
        if n.startswith("unused."):
            assert (param_region(buf, buf.grad_data, i) == 0).all()
    buf.disarm()
    assert buf.unfired() == []


# --------------------------------------------------------------------------- AdamW over flat shards


@st.composite
def runs_st(draw, n: int, max_runs: int = 5):
    """Disjoint ranges inside [0, n), in order; neighbours may touch."""
    runs, pos = [], 0
    for _ in range(draw(st.integers(0, max_runs))):
        start = pos + draw(st.integers(0, 4))
        end = start + draw(st.integers(1, 8))
        if end > n:
            break
        runs.append(Range(start, end))
        pos = end
    return runs


@st.composite
def adam_cases(draw):
    n = draw(st.integers(1, 60))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4)))) if n > 1 else []
    runs = draw(runs_st(n))
    steps = draw(st.integers(1, 5))
    lrs = draw(st.lists(st.floats(1e-4, 0.3), min_size=steps, max_size=steps))
    hyper = AdamWHyper(
        beta1=draw(st.sampled_from([0.9, 0.8])),
        beta2=draw(st.sampled_from([0.95, 0.999])),
        eps=draw(st.sampled_from([1e-8, 1e-6])),
        weight_decay=draw(st.sampled_from([0.0, 0.1, 0.7])),
    )
    seed = draw(st.integers(0, 2**16))
    return n, cuts, runs, lrs, hyper, seed


def split(t: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    edges = [0, *bounds, t.numel()]
    return [t[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def run_both(n, cuts, runs, lrs, hyper, seed, shuffle_runs=False):
    """FlatAdamW on bucket views of one flat tensor vs torch.optim.AdamW on per-piece tensors."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in lrs]

    # reference pieces: cut at every bucket edge and every run edge, so each piece either
    # decays entirely or not at all
    edges = sorted({*cuts, *(r.start for r in runs), *(r.end for r in runs)} - {0, n})
    decays = torch.zeros(n, dtype=torch.bool)
    for r in runs:
        decays[r.slice()] = True
    pieces = [nn.Parameter(p.clone()) for p in split(flat, edges)]
    starts = [0, *edges]
    groups = [
        {"params": [p for p, s in zip(pieces, starts) if decays[s]], "weight_decay": hyper.weight_decay},
        {"params": [p for p, s in zip(pieces, starts) if not decays[s]], "weight_decay": 0.0},
    ]
    ref = torch.optim.AdamW(
        [gr for gr in groups if gr["params"]], lr=lrs[0], betas=(hyper.beta1, hyper.beta2), eps=hyper.eps
    )

    decay_runs = list(runs)
    if shuffle_runs:
        random.Random(seed).shuffle(decay_runs)
    opt = FlatAdamW(split(flat, cuts), hyper, decay_runs)
    for lr, grad in zip(lrs, grads):
        opt.step(split(grad, cuts), lr)
        for p, gp in zip(pieces, split(grad, edges)):
            p.grad = gp.clone()
        for gr in ref.param_groups:
            gr["lr"] = lr
        ref.step()
    return flat, opt, pieces, ref


@FAST
@given(adam_cases())
def test_flat_adamw_matches_torch_adamw_piece_by_piece(case):
    n, cuts, runs, lrs, hyper, seed = case
    flat, opt, pieces, ref = run_both(n, cuts, runs, lrs, hyper, seed)
    torch.testing.assert_close(flat, torch.cat([p.detach() for p in pieces]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(opt.exp_avg, torch.cat([ref.state[p]["exp_avg"] for p in pieces]), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(
        opt.exp_avg_sq, torch.cat([ref.state[p]["exp_avg_sq"] for p in pieces]), atol=1e-9, rtol=1e-6
    )
    assert opt.step_count == len(lrs) == opt.state_dict()["step"]


def test_decay_runs_that_cut_through_buckets_and_parameters():
    # three "buckets" [0, 10) [10, 17) [17, 30); decaying "parameters" [3, 12) and [20, 26),
    # so decay starts and stops inside buckets and one run spans a bucket edge
    runs = [Range(3, 12), Range(20, 26)]
    hyper = AdamWHyper(weight_decay=0.5)
    flat, opt, pieces, ref = run_both(30, [10, 17], runs, [0.1, 0.05, 0.2, 0.01], hyper, seed=7, shuffle_runs=True)
    torch.testing.assert_close(flat, torch.cat([p.detach() for p in pieces]), atol=1e-6, rtol=1e-6)


def test_weight_decay_only_touches_the_decay_runs():
    # with zero gradients and zero moments the Adam update is 0, so only decay moves values
    flat = torch.ones(12)
    opt = FlatAdamW(split(flat, [5]), AdamWHyper(weight_decay=0.5), [Range(2, 4), Range(4, 7)])
    opt.step(split(torch.zeros(12), [5]), lr=0.1)
    expected = torch.ones(12)
    expected[2:7] = 1 - 0.1 * 0.5
    torch.testing.assert_close(flat, expected)


def test_zero_weight_decay_ignores_the_runs_and_matches_plain_adam():
    n, cuts, runs, lrs = 20, [6, 13], [Range(0, 20)], [0.1, 0.1, 0.03]
    hyper = AdamWHyper(weight_decay=0.0)
    flat, _, pieces, ref = run_both(n, cuts, runs, lrs, hyper, seed=3)
    torch.testing.assert_close(flat, torch.cat([p.detach() for p in pieces]), atol=1e-6, rtol=1e-6)
    assert all(gr["weight_decay"] == 0.0 for gr in ref.param_groups)


def test_flat_adamw_on_no_params_is_a_no_op():
    opt = FlatAdamW([], AdamWHyper(), [])
    opt.step([], lr=0.1)
    assert opt.exp_avg.numel() == 0 and opt.step_count == 1


# --------------------------------------------------------------------------- merge_runs


def test_merge_runs_worked_example():
    runs = [Range(10, 12), Range(5, 8), Range(0, 3), Range(3, 5), Range(13, 14), Range(12, 13)]
    assert merge_runs(runs) == [Range(0, 8), Range(10, 14)]
    assert merge_runs([]) == []
    assert merge_runs([Range(4, 6)]) == [Range(4, 6)]
    assert merge_runs([Range(0, 2), Range(3, 5)]) == [Range(0, 2), Range(3, 5)]


@settings(max_examples=200, deadline=None)
@given(runs_st(200, max_runs=30), st.randoms())
def test_merge_runs_sorts_and_joins_touching_runs_keeping_the_same_elements(runs, rnd):
    shuffled = list(runs)
    rnd.shuffle(shuffled)
    merged = merge_runs(shuffled)
    covered = sorted(i for r in runs for i in range(r.start, r.end))
    assert sorted(i for r in merged for i in range(r.start, r.end)) == covered
    for a, b in zip(merged, merged[1:]):
        assert a.end < b.start  # sorted, and anything that touched was joined
    assert len(merged) <= len(runs)
