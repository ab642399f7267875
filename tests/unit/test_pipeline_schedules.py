"""Pipeline schedules: every schedule is complete, ordered and deadlock-free, its simulated
bubble is the formula's, it holds the activations it promises, and a broken one is caught."""

import pytest

from rayzero.pipeline import schedules as S
from rayzero.pipeline.schedules import (Action, DeadlockError, bubble_formula, check, schedule, simulate,
                                        validate)

UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}

CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zero_bubble") for p in (1, 2, 4) for m in (4, 8, 16)]
CASES += [("interleaved_1f1b", p, m, v) for p in (2, 4) for v in (2, 3) for m in (4, 8, 16)]


def compute(rank: list[Action]) -> list[str]:
    return [str(a) for a in rank if a.op in ("F", "B", "I", "W")]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_schedule_is_valid_and_its_bubble_is_the_formula(name, p, m, v):
    actions = schedule(name, p, m, v)
    validate(actions, p, m, v)
    timeline = simulate(actions, UNIT)
    for r in range(p):
        assert timeline.bubble(r) == pytest.approx(bubble_formula(name, p, m, v), abs=1e-12)
        assert timeline.busy[r] == m * v * 3


@pytest.mark.parametrize("p, m", [(p, m) for p in (1, 2, 4) for m in (4, 8, 16)])
def test_activations_held(p, m):
    """1f1b holds p - r micro-batches between forward and backward; gpipe holds all m. ZB-H1's
    late W's keep a micro-batch's activations until its W: every rank within p micro-batches,
    1f1b's peak (its first rank's)."""
    one_f_one_b, zero_bubble, gpipe = (simulate(schedule(n, p, m)) for n in ("1f1b", "zero_bubble", "gpipe"))
    for r, rank in enumerate(schedule("zero_bubble", p, m)):
        assert one_f_one_b.peak_in_flight(r) == p - r
        assert gpipe.peak_in_flight(r) == m
        held = [sum((a.op == "F") - (a.op == "W") for a in rank[:k]) for k in range(len(rank) + 1)]
        assert zero_bubble.peak_in_flight(r) == max(held) <= max(one_f_one_b.peaks)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_is_a_third_of_1f1b(p, m):
    zb = simulate(schedule("zero_bubble", p, m)).bubble(0)
    assert zb <= simulate(schedule("1f1b", p, m)).bubble(0) / 3 + 1e-12


@pytest.mark.parametrize("costs", [{"F": 1.0, "I": 1.5, "W": 1.0}, {"F": 2.0, "I": 1.0, "W": 0.5}])
def test_zero_bubble_formula_with_uneven_costs(costs):
    """(p-1)(F+I-W) / (m(F+I+W)) while W <= min(F, I), as the module docstring says."""
    p, m = 4, 8
    f, i, w = costs["F"], costs["I"], costs["W"]
    assert simulate(schedule("zero_bubble", p, m), costs).bubble(0) == pytest.approx(
        (p - 1) * (f + i - w) / (m * (f + i + w)))


@pytest.mark.parametrize("m", [4, 8])
def test_a_slower_stage_sets_the_pace(m):
    """Costs per rank: with the last of 2 stages 10 % slower, gpipe's step is that stage's m
    micro-batches plus one of the first stage's forward and backward (the fill and the drain)."""
    fast, slow = {"F": 1.0, "B": 2.0}, {"F": 1.1, "B": 2.2}
    timeline = simulate(schedule("gpipe", 2, m), [fast, slow])
    assert timeline.makespan == pytest.approx(m * 3.3 + 3.0)
    assert timeline.busy == pytest.approx((m * 3.0, m * 3.3))
    assert simulate(schedule("1f1b", 4, m), [UNIT] * 4) == simulate(schedule("1f1b", 4, m), UNIT)


def test_orders_on_a_small_pipeline():
    assert compute(schedule("1f1b", 2, 4)[0]) == "F0c0 F1c0 B0c0 F2c0 B1c0 F3c0 B2c0 B3c0".split()
    assert compute(schedule("gpipe", 2, 3)[1]) == "F0c0 F1c0 F2c0 B2c0 B1c0 B0c0".split()
    # ZB-H1: rank r runs each W r micro-batches late
    assert compute(schedule("zero_bubble", 2, 4)[0]) == (
        "F0c0 F1c0 I0c0 W0c0 F2c0 I1c0 W1c0 F3c0 I2c0 W2c0 I3c0 W3c0".split())
    assert compute(schedule("zero_bubble", 2, 4)[1]) == (
        "F0c0 I0c0 F1c0 I1c0 W0c0 F2c0 I2c0 W1c0 F3c0 I3c0 W2c0 W3c0".split())
    # Megatron's interleaving: groups of p micro-batches per chunk, warm-up (p-r-1)*2 + (v-1)*p
    assert compute(schedule("interleaved_1f1b", 2, 4, 2)[0]) == (
        "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0".split())


def test_messages_surround_their_compute():
    assert [str(a) for a in schedule("1f1b", 2, 2)[1]] == [
        "RECV_F0c0", "F0c0", "B0c0", "SEND_B0c0", "RECV_F1c0", "F1c0", "B1c0", "SEND_B1c0"]
    first, last = schedule("interleaved_1f1b", 2, 2, 2)
    assert not any(a.op in ("RECV_F", "SEND_B") and a.chunk == 0 for a in first)  # stage 0
    assert not any(a.op in ("SEND_F", "RECV_B") and a.chunk == 1 for a in last)  # stage 3
    assert all(a.op in ("F", "B") for a in schedule("1f1b", 1, 4)[0])


def test_stages_are_interleaved_megatron_style():
    p, v = 4, 3
    assert [S.stage_of(0, c, p) for c in range(v)] == [0, 4, 8]
    assert all(S.place_of(S.stage_of(r, c, p), p) == (r, c) for r in range(p) for c in range(v))


def test_action_string():
    assert str(Action("F", 3, 1)) == "F3c1"
    assert str(Action("SEND_F", 3, 0)) == "SEND_F3c0"
    with pytest.raises(ValueError, match="RECV_B"):
        Action("X", 0)


def test_the_drawings_in_the_docstring_are_what_simulate_draws():
    rows = [line.strip() for line in S.__doc__.splitlines() if line.strip().startswith("rank ")]
    drawn = [simulate(schedule(name, 4, 8)).draw() for name in ("gpipe", "1f1b", "zero_bubble")]
    assert "\n".join(rows) == "\n".join(drawn)


def test_check_names_the_config_keys():
    assert check("1f1b", 4, 8) is None
    assert "parallel.pp (4)" in check("1f1b", 4, 3) and "got 3" in check("1f1b", 4, 3)
    assert "train.global_batch_size / train.micro_batch_size" in check("zero_bubble", 4, 2)
    assert "multiple of parallel.pp (4)" in check("interleaved_1f1b", 4, 6, 2)
    assert "parallel.pp_virtual_stages >= 2" in check("interleaved_1f1b", 4, 8, 1)
    assert "parallel.pp_virtual_stages must be 1" in check("1f1b", 1, 4, 2)
    unknown = check("pipedream", 2, 4)
    assert all(name in unknown for name in S.SCHEDULES)
    with pytest.raises(ValueError, match="at least parallel.pp"):
        schedule("1f1b", 4, 2)
    with pytest.raises(ValueError, match="unknown"):
        bubble_formula("pipedream", 2, 4)


def test_a_receive_after_its_compute_is_caught():
    actions = schedule("1f1b", 2, 4)
    rank = actions[1]
    k = rank.index(Action("RECV_F", 2))
    rank[k], rank[k + 1] = rank[k + 1], rank[k]  # F2 before its input arrives
    with pytest.raises(ValueError, match="runs F2c0 before RECV_F2c0"):
        validate(actions, 2, 4)
    with pytest.raises(DeadlockError, match="rank 1 at F2c0"):
        simulate(actions)


def test_sends_out_of_order_on_a_link_are_caught():
    actions = schedule("gpipe", 2, 4)
    rank = actions[0]
    second = rank.index(Action("SEND_F", 1))
    rank.remove(Action("SEND_F", 0))  # send micro-batch 0 after micro-batch 1
    rank.insert(second, Action("SEND_F", 0))
    with pytest.raises(ValueError, match="rank 0 sends to rank 1 in the order"):
        validate(actions, 2, 4)
    with pytest.raises(ValueError, match="next message on that link is F1"):
        simulate(actions)


def test_a_receive_too_early_deadlocks_though_the_order_is_valid():
    """Receiving the gradient before sending the activation it comes from is well ordered on
    each rank, and hangs both: only the simulation sees it."""
    actions = schedule("1f1b", 2, 4)
    actions[0].remove(Action("RECV_B", 0))
    actions[0].insert(0, Action("RECV_B", 0))
    validate(actions, 2, 4)
    with pytest.raises(DeadlockError, match=r"rank 0 at RECV_B0c0, rank 1 at RECV_F0c0"):
        simulate(actions)


def test_incomplete_or_mixed_schedules_are_rejected():
    actions = schedule("1f1b", 2, 4)
    actions[1].remove(Action("B", 3))
    with pytest.raises(ValueError, match=r"rank 1: missing \['B3c0'\]"):
        validate(actions, 2, 4)
    actions = schedule("zero_bubble", 2, 4)
    actions[0].append(Action("B", 0))
    with pytest.raises(ValueError, match="mixes B with I and W"):
        validate(actions, 2, 4)
