"""The flat per-bucket parameter storage, its release/restore, its gradient hooks, and AdamW over flat shards."""

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
from rayzero.sharding.layout import Range, build_layout

FAST = settings(max_examples=60, deadline=None)

CFG = ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=40)
BLOCK = 8


def tiny_gpt(device="cpu"):
    return build_model(CFG, BLOCK, seed=0, device=device)


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


def flat_gpt(dp_size=3, bucket_numel=500, shard_align=4, dtype=torch.float32):
    """The model built on the meta device, materialized into a flat buffer from its init."""
    model = tiny_gpt("meta")
    named = list(reversed(list(model.named_parameters())))
    layout = build_layout([p.numel() for _, p in named], dp_size, bucket_numel, shard_align)
    buf = FlatBuffer(model, named, layout, dtype, torch.device("cpu"))
    for b in buf.buckets:
        buf.materialize(b, lambda name, out: model.init_parameter(name, out, 0))
    return model, buf


def region(buf: FlatBuffer, i: int) -> torch.Tensor:
    span = buf.layout.params[i]
    b = buf.buckets[span.bucket]
    return buf.data[b.index][span.world.shift(-b.world.start).slice()]


# --------------------------------------------------------------------------- storage


def test_params_are_views_into_their_bucket_and_padding_is_zero():
    model, buf = flat_gpt()
    assert len(buf.buckets) > 2 and buf.layout.padding > 0  # the case is not trivial
    named = dict(model.named_parameters())
    for i, name in enumerate(buf.names):
        p = buf.params[i]
        assert named[name] is p, "the model holds the buffer's parameters"
        assert p.data_ptr() == region(buf, i).data_ptr() and p.is_contiguous()
        assert p.untyped_storage().data_ptr() == buf.data[buf.bucket_of(i)].untyped_storage().data_ptr()
    used = sum(s.numel for s in buf.layout.params)
    assert sum(d.count_nonzero() for d in buf.data) <= used
    for b in buf.buckets:
        assert (buf.data[b.index][b.data_end - b.world.start:] == 0).all()


def test_materialized_values_equal_the_plain_model_and_the_tie_survives():
    model, buf = flat_gpt()
    ref = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" not in buf.names  # the tied weight is stored once
    for name, p in ref.named_parameters():
        assert torch.equal(buf.named_views()[name].detach(), p.detach()), name
    idx, _ = batch(0)
    with torch.no_grad():
        assert torch.equal(model(idx), ref(idx))


def test_writing_a_bucket_changes_its_parameters():
    model, buf = flat_gpt()
    for i, p in enumerate(buf.params):
        region(buf, i).fill_(float(i + 1))
        assert (p.detach() == i + 1).all()


def test_bf16_storage_rounds_the_fp32_values_it_returns():
    model = tiny_gpt("meta")
    named = list(model.named_parameters())
    layout = build_layout([p.numel() for _, p in named], 1, 10**6)
    buf = FlatBuffer(model, named, layout, torch.bfloat16, torch.device("cpu"))
    full32 = buf.materialize(buf.buckets[0], lambda name, out: model.init_parameter(name, out, 0))
    assert full32.dtype == torch.float32 and buf.data[0].dtype == torch.bfloat16
    assert torch.equal(buf.data[0], full32.to(torch.bfloat16))
    assert not torch.equal(buf.data[0].float(), full32)


def test_release_frees_storage_and_restore_brings_back_what_autograd_saved():
    """ZeRO-3's mechanic: free a bucket between forward and backward, gather it back in
    place (here: copy), and backward still computes the right gradients."""
    model, buf = flat_gpt()
    saved = [d.clone() for d in buf.data]
    loss = loss_of(model, 4)
    for b in buf.buckets:
        buf.release(b)
        assert not buf.is_resident(b) and buf.data[b.index].untyped_storage().nbytes() == 0
    for b in buf.buckets:
        buf.restore(b)
        buf.data[b.index].copy_(saved[b.index])
    loss.backward()
    expected = reference_grads([4])
    for i, name in enumerate(buf.names):
        torch.testing.assert_close(buf.params[i].grad, expected[name], msg=name)


def test_the_storages_the_activation_meter_leaves_out_follow_release_and_restore():
    """`storage_ptrs()` (asked for every saved tensor) is kept between calls, yet always names
    the buckets' storages as they are now: a ZeRO-3 unit gathered mid-forward gets a new one."""
    model, buf = flat_gpt()

    def now():
        return {d.untyped_storage().data_ptr() for d in buf.data}

    assert buf.storage_ptrs() == now() and buf.storage_ptrs() is buf.storage_ptrs()
    first = buf.buckets[0]
    buf.release(first)
    assert buf.storage_ptrs() == now() and 0 in now()
    buf.restore(first)
    assert buf.storage_ptrs() == now() and 0 not in now()


def test_a_layout_that_does_not_fit_is_refused():
    model = tiny_gpt("meta")
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="parameters for a layout"):
        FlatBuffer(model, named[:-1], build_layout([p.numel() for _, p in named], 1, 10), torch.float32, "cpu")


# --------------------------------------------------------------------------- gradient hooks


@pytest.mark.parametrize("dp_size,bucket_numel,align", [(3, 500, 4), (2, 1, 1), (4, 2000, 8), (1, 10**6, 1)])
def test_each_parameter_reports_its_final_gradient_once_and_buckets_count_down(dp_size, bucket_numel, align):
    model, buf = flat_gpt(dp_size, bucket_numel, align)
    expected = reference_grads([5])
    calls, completed = [], []

    def on_grad(i, param):
        calls.append(i)
        torch.testing.assert_close(param.grad, expected[buf.names[i]], msg=buf.names[i])
        b = buf.buckets[buf.bucket_of(i)]
        if buf.pending(b) == 0:
            completed.append(b.index)

    buf.arm(on_grad)
    loss_of(model, 5).backward()
    assert sorted(calls) == list(range(len(buf.params)))
    assert sorted(completed) == list(range(len(buf.buckets)))
    if len(buf.buckets) > 1:
        # the tied embedding's gradient is the last to be final: its bucket completes last
        wte = buf.names.index("wte.weight")
        assert calls[-1] == wte and completed[-1] == buf.bucket_of(wte)


def test_disarmed_backward_reports_nothing():
    model, buf = flat_gpt(bucket_numel=1)
    calls = []
    buf.arm(lambda i, p: calls.append(i))
    buf.disarm()
    loss_of(model, 2).backward()
    assert calls == [] and all(buf.pending(b) == 0 for b in buf.buckets)
    torch.testing.assert_close(buf.named_views()["wte.weight"].grad, reference_grads([2])["wte.weight"])


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.unused = nn.Linear(4, 3)
        self.b = nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_buckets_of_parameters_without_gradient_stay_pending():
    torch.manual_seed(0)
    model = WithUnused()
    named = list(model.named_parameters())
    layout = build_layout([p.numel() for _, p in named], 2, 12)
    buf = FlatBuffer(model, named, layout, torch.float32, "cpu")
    values = {n: p.detach().clone() for n, p in named}
    for b in buf.buckets:
        buf.materialize(b, lambda name, out: out.copy_(values[name]))
    buf.arm(lambda i, p: None)
    model(torch.randn(6, 4)).pow(2).sum().backward()
    unused = {buf.bucket_of(i) for i, n in enumerate(buf.names) if n.startswith("unused.")}
    assert unused
    assert {b.index for b in buf.buckets if buf.pending(b) > 0} == unused



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


def test_flat_adamw_applies_the_clip_coefficient_as_torch_clips_the_gradients():
    # `grad_scale` multiplies the gradients inside the update: the same as clipping them first.
    n, cuts, runs = 50, [20, 33], [Range(5, 40)]
    hyper = AdamWHyper(weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    start, grads = torch.randn(n, generator=g), [torch.randn(n, generator=g) for _ in range(3)]
    scaled, clipped = start.clone(), start.clone()
    a = FlatAdamW(split(scaled, cuts), hyper, runs)
    b = FlatAdamW(split(clipped, cuts), hyper, runs)
    for grad in grads:
        a.step(split(grad.clone(), cuts), lr=0.01, grad_scale=0.3)
        b.step(split(grad * 0.3, cuts), lr=0.01)
    torch.testing.assert_close(scaled, clipped, atol=1e-7, rtol=1e-6)


def test_flat_adamw_takes_low_precision_gradients_and_long_shards(monkeypatch):
    # bf16 gradients are updated in fp32 segment by segment; a shard longer than CHUNK is cut.
    import rayzero.sharding.adamw as adamw

    monkeypatch.setattr(adamw, "CHUNK", 16)
    n = 100
    g = torch.Generator().manual_seed(2)
    start, grad = torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16()
    low, full = start.clone(), start.clone()
    a = FlatAdamW(split(low, [60]), AdamWHyper(), [Range(10, 70)])
    assert max(s.hi - s.lo for s in a._segments) == 16
    a.step(split(grad, [60]), lr=0.01)
    FlatAdamW(split(full, [60]), AdamWHyper(), [Range(10, 70)]).step(split(grad.float(), [60]), lr=0.01)
    assert torch.equal(low, full) and not torch.equal(low, start)


def test_a_step_allocates_no_new_segment_views_for_the_same_gradients():
    flat, grads = torch.zeros(30), torch.ones(30)
    opt = FlatAdamW(split(flat, [10]), AdamWHyper(), [Range(0, 30)])
    opt.step(split(grads, [10]), lr=0.1)
    views = opt._grad_views
    opt.step(split(grads, [10]), lr=0.1)  # new view objects of the same memory: the cache holds
    assert opt._grad_views is views
    opt.step(split(torch.ones(30), [10]), lr=0.1)  # other memory: cut again
    assert opt._grad_views is not views


def test_a_parameter_read_in_many_pieces_is_made_whole_once():
    """A row-parallel weight's TP slice is a run per row: a seeded source (whole tensors only)
    makes each parameter once for all its pieces, not once per piece (at tp 2 that was a
    whole-tensor draw per row: 12 s of an 8-rank start)."""
    from rayzero.sharding.flat_buffer import FillSource, Piece

    made = []

    def fill(name, out):
        made.append(name)
        out.copy_(torch.arange(out.numel(), dtype=torch.float32).view(out.shape) + (100 if name == "b" else 0))

    a, b = torch.zeros(8 * 4), torch.zeros(3 * 5)
    pieces = [Piece("a", r * 4 + 1, r * 4 + 3, (8, 4), a[r * 2: r * 2 + 2]) for r in range(8)]
    pieces += [Piece("b", 0, 15, (3, 5), b), Piece("a", 0, 2, (8, 4), a[16:18])]
    FillSource(fill).fill_pieces(pieces)
    assert made == ["a", "b"], "once for all of its pieces in a row"
    assert a[:16].tolist() == [float(r * 4 + k) for r in range(8) for k in (1, 2)] and a[16:18].tolist() == [0.0, 1.0]
    assert b.tolist() == [100.0 + k for k in range(15)]
