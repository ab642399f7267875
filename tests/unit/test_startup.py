"""The start-up's status lines: one per stage as it begins, its time since the start, and each
stage's seconds once the first step is done."""

import io
import re

from rayzero.cluster.startup import Startup


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_stage_is_one_line_with_its_time_and_the_stages_add_up_to_the_first_step(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("rayzero.cluster.startup.time.monotonic", clock)
    out = io.StringIO()
    s = Startup(out)
    for key, seconds in (("checks", 0.5), ("ray", 3.0), ("placement", 1.25), ("first_step", 0.75)):
        s.stage(key, f"{key} begins")
        clock.now += seconds
    assert s.timings() == {}, "nothing to time before the first step"
    s.first_step()
    clock.now += 60
    s.first_step()  # the steps after it change nothing
    s.stage("placement", "placing again")  # a restart's rebuild: said, not timed
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["rayzero: [   0.0s] checks begins", "rayzero: [   0.5s] ray begins"]
    assert lines[-1] == "rayzero: [  65.5s] placing again"
    assert all(re.fullmatch(r"rayzero: \[ *\d+\.\ds\] .+", line) for line in lines)
    assert s.timings() == {"checks_s": 0.5, "ray_s": 3.0, "placement_s": 1.25, "first_step_s": 0.75, "total_s": 5.5}


def test_a_local_ray_a_run_starts_has_no_dashboard_unless_asked(monkeypatch):
    """The Ray a run starts for itself leaves its dashboard out (about 2 s of the start here:
    `ray.init()` 9.1 s with it, 6.8 s without); `cluster.dashboard=true` asks for it, and a
    cluster the run joins is given no options at all (Ray refuses `include_dashboard` there)."""
    from rayzero.config import load_config
    from rayzero.cluster.local_ray import local_ray_options

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert local_ray_options(load_config(None, [])) == {"include_dashboard": False}
    assert local_ray_options(load_config(None, ["cluster.dashboard=true"])) == {}
    assert local_ray_options(load_config(None, ["cluster.address=auto"])) == {}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # as `ray job submit` gives a job
    assert local_ray_options(load_config(None, [])) == {}


def test_what_waits_for_the_start_up_runs_once_at_the_first_step():
    """`when_done` (the tracker's `begin`): called at the first step's end, once; after it, at once."""
    s = Startup(io.StringIO())
    calls = []
    s.when_done(lambda: calls.append("a"))
    s.stage("checks", "checks begins")
    assert calls == []
    s.first_step()
    s.first_step()
    assert calls == ["a"]
    s.when_done(lambda: calls.append("b"))
    assert calls == ["a", "b"]


def test_the_placement_line_counts_its_ranks_in_words():
    from rayzero.cluster.states import ranks_words

    assert [ranks_words(n) for n in (1, 2, 4)] == ["1 rank", "2 ranks", "4 ranks"]


def test_the_first_step_s_compilation_is_a_part_of_its_stage_said_apart(monkeypatch):
    """`train.compile`: what the first step spent compiling is in the timings as `torch_compile_s`,
    inside the first step's stage (not added to the total), and the summary's line says so;
    what the steps after it compile (none, or an evaluation's graph) is not the start-up's."""
    from rayzero.jobs.printed import startup_line as _startup_line

    clock = Clock()
    monkeypatch.setattr("rayzero.cluster.startup.time.monotonic", clock)
    s = Startup(io.StringIO())
    for key, seconds in (("checks", 1.0), ("first_step", 22.5)):
        s.stage(key, f"{key} begins")
        clock.now += seconds
    s.part("torch_compile", 20.25)
    s.first_step()
    s.part("torch_compile", 3.0)
    t = s.timings()
    assert t == {"checks_s": 1.0, "first_step_s": 22.5, "torch_compile_s": 20.25, "total_s": 23.5}
    assert _startup_line(t) == ("first step done 23.5 s after the start "
                                "(checks 1.0, first step 22.5 s, of which torch compile 20.2 s)")
