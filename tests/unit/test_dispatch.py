"""The compiled-graph dispatcher's nap: how long the driver sleeps before it spins on a result."""

import pytest

from rayzero.cluster.dispatch import LAST_SHARE, NAP_MIN_S, Nap, _work_s


def result(*phases: float, done_at: float | None = None) -> dict:
    out = {"phase_s": dict(zip(["gather", "forward", "backward", "step"], phases))}
    if done_at is not None:
        out["done_at"] = done_at
    return out


def test_an_iteration_lasts_as_long_as_its_slowest_rank_worked():
    assert _work_s([result(0.1, 0.2, 0.3, 0.05), result(0.1, 0.25, 0.3, 0.05)]) == 0.1 + 0.25 + 0.3 + 0.05


def test_results_without_phase_times_leave_it_to_the_driver_clock():
    assert _work_s([{"rank": 0}, {"rank": 1}]) is None
    assert _work_s([result(0.1), {"rank": 1}]) is None
    assert _work_s([]) is None


def test_no_nap_before_anything_is_known():
    assert Nap().wake_at(submitted=100.0, now=100.0) is None


def compiled() -> Nap:
    """A nap past the first iteration (the compile's), which sets only where the next begins."""
    nap = Nap()
    nap.observe([result(9.0, done_at=0.0)], submitted=-9.0, woke=-9.0, done=0.0)
    return nap


def test_the_iteration_after_the_first_timed_one_already_sleeps():
    # The second iteration's times guide the third (the first, the compile's, guides nothing).
    nap = compiled()
    nap.observe([result(1.0, done_at=101.0), result(1.0, done_at=101.2)], submitted=100.0, woke=100.0, done=101.3)
    assert nap.wake_at(submitted=100.05, now=101.3) == pytest.approx(101.2 + 1.0)


def test_an_iteration_starts_when_the_slowest_rank_ended_the_one_before():
    nap = compiled()
    for k, end in enumerate([11.0, 12.0, 13.0]):
        nap.observe([result(0.5, 0.5, done_at=end - 0.1), result(0.5, 0.5, done_at=end)],
                    submitted=10.0 + k, woke=end, done=end + 0.4)
    # Submitted long before the last one ended: it began when that ended, not when the driver
    # read it (0.4 s later, a nap's overshoot that would otherwise add up iteration by iteration).
    assert nap.wake_at(submitted=12.5, now=13.4) == pytest.approx(13.0 + 1.0)
    # Submitted after the last one ended (nothing was queued): it began when submitted.
    assert nap.wake_at(submitted=13.7, now=13.7) == pytest.approx(13.7 + 1.0)


def test_the_median_of_recent_iterations_ignores_one_slow_iteration():
    nap = compiled()
    for k, work in enumerate([1.0, 5.0, 1.2]):  # e.g. a checkpoint or validation step
        nap.observe([result(work, done_at=10.0 * (k + 1))], submitted=0.0, woke=0.0, done=10.0 * (k + 1))
    assert nap.wake_at(submitted=29.0, now=30.0) == pytest.approx(30.0 + 1.2)


def test_a_rank_clock_ahead_of_the_driver_cannot_make_it_sleep_past_one_iteration():
    nap = compiled()
    nap.observe([result(2.0, done_at=1000.0)], submitted=0.0, woke=0.0, done=10.0)  # clock 990 s ahead
    assert nap.wake_at(submitted=9.0, now=10.0) == pytest.approx(12.0)


def test_short_iterations_are_not_slept_on():
    nap = compiled()
    nap.observe([result(NAP_MIN_S / 2, done_at=1.0)], submitted=0.0, woke=0.0, done=1.0)
    assert nap.wake_at(submitted=1.0, now=1.0) is None


def test_without_phase_times_or_end_times_the_driver_clock_guides_it():
    nap = Nap()
    nap.observe([{"rank": 0}], submitted=-5.0, woke=-5.0, done=0.0)
    nap.observe([{"rank": 0}], submitted=0.0, woke=0.0, done=2.0)  # waited 2 s: the work took 2 s
    assert nap.wake_at(submitted=1.0, now=2.0) == pytest.approx(2.0 + 2.0)


def test_merged_results_give_their_slowest_rank_s_work():
    merged = {"ranks": 4, "work_s": 0.7, "phase_s": {"gather": 0.1, "forward": 0.6}}
    assert _work_s([merged, result(0.1, 0.2)]) == pytest.approx(0.7)


def test_a_slow_first_iteration_does_not_set_the_pace():
    nap = Nap()
    nap.observe([result(5.0, done_at=105.0)], submitted=100.0, woke=100.0, done=105.1)  # compiling
    assert nap.wake_at(submitted=105.0, now=105.1) is None  # nothing known yet of an ordinary one
    nap.observe([result(0.5, done_at=105.6)], submitted=105.0, woke=105.1, done=105.6)
    assert nap.wake_at(submitted=105.5, now=105.6) == pytest.approx(105.6 + 0.5)


def test_with_nothing_queued_behind_it_the_driver_wakes_before_the_expected_end():
    """The last iteration, or one whose evaluation may end the run: a late wake would hold up
    what comes next, so the nap ends at LAST_SHARE of the expected time (it spun through the
    whole iteration before: on 2 cores beside 2 ranks, their step took 2.0x as long)."""
    nap = compiled()
    nap.observe([result(1.0, done_at=11.0)], submitted=10.0, woke=10.0, done=11.0)
    assert nap.wake_at(submitted=11.0, now=11.0, queued=False) == pytest.approx(11.0 + LAST_SHARE * 1.0)
    assert nap.wake_at(submitted=11.0, now=11.0, queued=True) == pytest.approx(11.0 + 1.0)


def test_without_phase_times_an_overlong_nap_is_halved_not_slowly_decayed():
    nap = Nap()
    nap.observe([{"rank": 0}], submitted=0.0, woke=0.0, done=2.0)  # the first: where the next begins
    nap.observe([{"rank": 0}], submitted=1.0, woke=2.0, done=4.0)  # waited: 2 s of work
    nap.observe([{"rank": 0}], submitted=3.0, woke=4.0, done=6.0)
    assert nap.wake_at(submitted=5.0, now=6.0) == pytest.approx(8.0)
    # the iterations became short: done before the driver woke, twice; the guess halves each time
    nap.observe([{"rank": 0}], submitted=5.0, woke=8.0, done=8.0)  # began at 6
    assert nap.wake_at(submitted=7.0, now=8.0) == pytest.approx(7.0 + 1.0)
    nap.observe([{"rank": 0}], submitted=7.0, woke=8.0, done=8.0)
    assert nap.wake_at(submitted=7.5, now=8.0) == pytest.approx(7.5 + 0.5)


def test_an_unguessed_iteration_is_waited_for_by_asking_the_ranks(monkeypatch):
    """The first two iterations: the driver asks each rank's `progress` (no spinning) until every
    rank has finished the step, and stops asking when the ranks that have not are in that step
    in no phase, twice running (one raised; the channel's read reports it)."""
    from types import SimpleNamespace

    from rayzero.cluster import dispatch as d

    monkeypatch.setattr(d.ray, "get", lambda answers, timeout=None: list(answers))
    monkeypatch.setattr(d.time, "sleep", lambda s: None)

    def ranks(*timelines):  # each rank's answers, one per poll (the last repeats)
        polls = [iter(t) for t in timelines]
        seen = [[] for _ in timelines]

        def answer(k):
            def read():
                seen[k].append(next(polls[k], seen[k][-1] if seen[k] else None))
                return seen[k][-1]
            return read
        return [SimpleNamespace(progress=SimpleNamespace(remote=answer(k))) for k in range(len(timelines))], seen

    def wait(actors):
        cd = object.__new__(d.CompiledDispatch)
        cd.actors, cd.timeout_s = actors, 60.0
        cd._until_finished(step=4)

    before = {"step": 3, "phase": None, "finished": 3}  # not yet in step 4
    forward, done = {"step": 4, "phase": "forward", "finished": 3}, {"step": 4, "phase": None, "finished": 4}
    actors, seen = ranks([before, before, forward, forward, done], [forward, done])
    wait(actors)
    assert len(seen[0]) == 5, "asked until both had finished step 4, a rank not yet in it waited for"
    raised = {"step": 4, "phase": None, "finished": 3}
    actors, seen = ranks([forward, raised], [forward, done])
    wait(actors)
    assert len(seen[0]) == 3, "rank 0 raised in step 4: seen idle twice, then left to the channel"
