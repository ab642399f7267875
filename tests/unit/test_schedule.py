"""The learning-rate schedule: linear warmup, then cosine decay to min_lr.

The controller runs steps ``0 .. total_steps - 1`` and asks for ``lr_at(step, total_steps, ...)``.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayzero.cluster.schedule import lr_at
from rayzero.sharding.config import OptimConfig

FAST = settings(max_examples=100, deadline=None)


def schedule(total: int, cfg: OptimConfig) -> list[float]:
    return [lr_at(s, total, cfg) for s in range(total)]


@st.composite
def cases(draw):
    lr = draw(st.floats(1e-6, 1.0))
    min_lr = draw(st.floats(0.0, 1.0)) * lr
    warmup = draw(st.integers(0, 50))
    total = draw(st.integers(warmup + 2, warmup + 300))
    return total, OptimConfig(lr=lr, min_lr=min_lr, warmup_steps=warmup)


def test_warmup_is_linear_and_reaches_lr_at_its_last_step():
    cfg = OptimConfig(lr=0.8, min_lr=0.0, warmup_steps=4)
    lrs = schedule(20, cfg)
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lrs[3] == pytest.approx(cfg.lr)


@FAST
@given(cases())
def test_warmup_rises_by_equal_steps_to_lr(case):
    total, cfg = case
    w = cfg.warmup_steps
    lrs = schedule(total, cfg)
    for s in range(w):
        assert lrs[s] == pytest.approx(cfg.lr * (s + 1) / w)
    if w:
        assert lrs[w - 1] == pytest.approx(cfg.lr)
        assert all(a < b for a, b in zip(lrs[:w], lrs[1:w]))


@FAST
@given(cases())
def test_lr_never_increases_after_warmup_and_stays_within_bounds(case):
    total, cfg = case
    lrs = schedule(total, cfg)
    after = lrs[max(cfg.warmup_steps - 1, 0):]
    for a, b in zip(after, after[1:]):
        assert b <= a + 1e-12
    for x in lrs:
        assert x <= cfg.lr * (1 + 1e-12)
    for x in lrs[cfg.warmup_steps:]:
        assert x >= cfg.min_lr * (1 - 1e-12)


def test_decay_follows_a_cosine():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0)
    lrs = schedule(101, cfg)
    assert lrs[0] == pytest.approx(1.0)
    assert lrs[50] == pytest.approx(0.5 * (1 + math.cos(math.pi * 50 / 100)), abs=0.02)


@pytest.mark.parametrize("total, warmup", [(10, 0), (10, 3), (3, 0), (100, 10), (2, 1)])
def test_cosine_reaches_min_lr_at_the_last_step(total, warmup):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=warmup)
    assert schedule(total, cfg)[-1] == pytest.approx(cfg.min_lr)


def test_zero_warmup_starts_at_lr():
    cfg = OptimConfig(lr=0.5, min_lr=0.05, warmup_steps=0)
    lrs = schedule(10, cfg)
    assert lrs[0] == pytest.approx(0.5)
    assert all(math.isfinite(x) for x in lrs)
    assert all(b <= a for a, b in zip(lrs, lrs[1:]))


def test_single_step_run_with_no_warmup_is_finite():
    cfg = OptimConfig(lr=0.5, min_lr=0.05, warmup_steps=0)
    assert math.isfinite(lr_at(0, 1, cfg))
    assert cfg.min_lr <= lr_at(0, 1, cfg) <= cfg.lr


def test_min_lr_equal_to_lr_gives_a_constant_after_warmup():
    cfg = OptimConfig(lr=0.3, min_lr=0.3, warmup_steps=2)
    assert schedule(12, cfg)[1:] == pytest.approx([0.3] * 11)


def test_final_lr_defaults_to_a_tenth_of_lr_so_a_low_lr_alone_is_valid():
    from rayzero.config import load_config

    cfg = load_config(None, ["optim.lr=1e-4", "optim.warmup_steps=0"])
    assert cfg.optim.final_lr == pytest.approx(1e-5)
    assert schedule(10, cfg.optim)[-1] == pytest.approx(1e-5)


# --------------------------------------------------------------------------- the other schedules

@pytest.mark.parametrize("total, warmup", [(20, 0), (20, 4), (3, 1)])
def test_linear_decays_in_equal_steps_to_min_lr_at_the_last_step(total, warmup):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=warmup, schedule="linear")
    lrs = schedule(total, cfg)
    peak, last = max(warmup - 1, 0), total - 1
    want = [1.0 + (0.1 - 1.0) * (s - peak) / max(1, last - peak) for s in range(peak, total)]
    assert lrs[peak:] == pytest.approx(want) and lrs[-1] == pytest.approx(0.1)


def test_constant_stays_at_lr_after_warmup():
    cfg = OptimConfig(lr=0.4, min_lr=0.0, warmup_steps=3, schedule="constant")
    assert schedule(10, cfg) == pytest.approx([0.4 / 3, 0.8 / 3, 0.4] + [0.4] * 7)
    assert lr_at(500, 10, cfg) == 0.4  # past the end too


def test_wsd_holds_lr_then_decays_over_the_last_fraction():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=2, schedule="wsd", decay_fraction=0.25)
    lrs = schedule(20, cfg)  # stable through step 14, then 5 steps down: 15 .. 19 (min_lr)
    assert lrs[:2] == pytest.approx([0.5, 1.0]) and lrs[2:15] == pytest.approx([1.0] * 13)
    assert lrs[15:] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0])


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd"])
def test_past_its_end_a_schedule_stays_at_min_lr(name):
    cfg = OptimConfig(lr=1.0, min_lr=0.05, warmup_steps=2, schedule=name)
    assert [lr_at(s, 10, cfg) for s in (9, 10, 15, 1000)] == pytest.approx([0.05] * 4)


def test_a_resume_keeps_the_schedule_it_started_with_unless_told():
    from rayzero.cluster.schedule import describe, schedule_length

    manifest = {"schedule": {"step": 10, "total_steps": 10, "lr": 0.1}}
    assert schedule_length(20, OptimConfig(), manifest) == 10
    assert schedule_length(20, OptimConfig(schedule_total="new"), manifest) == 20
    assert schedule_length(20, OptimConfig(), None) == 20  # a fresh start
    assert describe(100, OptimConfig(lr=1e-3, warmup_steps=10)) == \
        "lr cosine: warmup 10 steps to 0.001, cosine decay to 0.0001 at step 99"
    assert describe(100, OptimConfig(lr=1e-3, warmup_steps=0, schedule="wsd")) == (
        "lr wsd: 0.001, stable to step 79, then linear decay over the last 20 steps (0.2 of 100) to 0.0001 at step 99")
    assert describe(10, OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant")) == "lr constant: 0.001, then 0.001 to the end"
