"""The compiled-graph dispatcher's nap: how long the driver sleeps before it spins on a result."""

from rayzero.cluster.dispatch import _work_s


def result(*phases: float) -> dict:
    return {"phase_s": dict(zip(["gather", "forward", "backward", "step"], phases))}


def test_an_iteration_lasts_as_long_as_its_slowest_rank_worked():
    assert _work_s([result(0.1, 0.2, 0.3, 0.05), result(0.1, 0.25, 0.3, 0.05)]) == 0.1 + 0.25 + 0.3 + 0.05


def test_results_without_phase_times_leave_it_to_the_driver_clock():
    assert _work_s([{"rank": 0}, {"rank": 1}]) is None
    assert _work_s([result(0.1), {"rank": 1}]) is None
    assert _work_s([]) is None
