"""The failure policy, the classification of errors, the watchdog's verdict and the elastic
world sizes, without a cluster."""

import pytest
import ray.exceptions
import torch.distributed as dist

from rayzero.storage import StorageError
from rayzero.cluster.history import History
from rayzero.cluster.failure import Failure, FailurePolicy, classify, first_line
from rayzero.cluster.scaling import ScalingPolicy
from rayzero.cluster.watchdog import Watchdog
from rayzero.cluster.worker_group import PlacementError
from rayzero.config import ConfigError, load_config

ELASTIC = ["cluster.num_workers=4", "cluster.min_workers=2", "train.global_batch_size=24",
           "train.micro_batch_size=2"]


def policy(*overrides):
    return FailurePolicy(load_config(None, [*ELASTIC, *overrides]))


def died(step=5):
    return Failure("rank_died", "rank 1 died", rank=1, step=step)


def test_restart_at_the_same_world_when_the_cluster_still_holds_it():
    d = policy().decide(died(), restarts=0, streak=1, world=4, capacity=4)
    assert (d.action, d.world_size, d.delay_s) == ("restart", 4, 1.0)


def test_backoff_doubles_while_nothing_commits_and_is_capped():
    p = policy("failure.backoff_s=2", "failure.backoff_max_s=5")
    assert [p.decide(died(), 0, streak, 4, 4).delay_s for streak in (1, 2, 3, 4)] == [2, 4, 5, 5]


def test_shrink_to_the_largest_world_that_fits_and_divides_the_batch():
    d = policy().decide(died(), restarts=0, streak=1, world=4, capacity=3)
    assert (d.action, d.world_size) == ("shrink", 3)
    # 24 sequences of 2 per micro-batch: 4, 3 and 2 ranks divide them; with 16 only 4 and 2 do.
    d = policy("train.global_batch_size=16").decide(died(), 0, 1, world=4, capacity=3)
    assert (d.action, d.world_size) == ("shrink", 2)


def test_below_min_workers_waits_for_resources_at_the_same_world():
    d = policy().decide(died(), restarts=0, streak=1, world=4, capacity=1)
    assert (d.action, d.world_size) == ("restart", 4)


def test_without_elastic_never_shrinks():
    d = policy("cluster.min_workers=null").decide(died(), 0, 1, world=4, capacity=3)
    assert (d.action, d.world_size) == ("restart", 4)


def test_gives_up_when_restarts_run_out_and_never_with_minus_one():
    assert policy("failure.max_restarts=2").decide(died(), 2, 1, 4, 4).action == "give_up"
    assert policy("failure.max_restarts=2").decide(died(), 1, 1, 4, 4).action == "restart"
    assert policy("failure.max_restarts=-1").decide(died(), 10_000, 1, 4, 4).action == "restart"
    assert "failure.max_restarts=0" in policy("failure.max_restarts=0").decide(died(), 0, 1, 4, 4).reason


def test_an_error_in_the_training_code_is_not_retried():
    d = policy().decide(Failure("error", "ValueError: bad"), 0, 1, 4, 4)
    assert d.action == "give_up" and "training code" in d.reason


def task_error(cause: Exception) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("RankShim.step", "Traceback…", cause, type(cause)).as_instanceof_cause()


@pytest.mark.parametrize("exc, kind", [
    (PlacementError("no room"), "placement"),
    (ray.exceptions.ActorDiedError(), "rank_died"),
    (ray.exceptions.GetTimeoutError(), "hang"),
    (ray.exceptions.RayChannelTimeoutError("slow"), "hang"),
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4100"), "collective"),
    (dist.DistNetworkError("timeout"), "collective"),
    (StorageError("s3 down"), "storage"),
    (ValueError("shape mismatch"), "error"),
])
def test_classify(exc, kind):
    assert classify(exc) == kind
    if not isinstance(exc, (ray.exceptions.RayError, PlacementError)):
        assert classify(task_error(exc)) == kind, "the same through a rank's RayTaskError"


def test_first_line_is_the_cause_in_one_line():
    assert first_line(task_error(ValueError("bad shape\nmore detail"))) == "ValueError: bad shape"
    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: RankShim\n"
            "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR …")

    class Died(ray.exceptions.ActorDiedError):  # Ray builds the real one from a context
        def __init__(self, text):
            self.text = text

        def __str__(self):
            return self.text

    assert first_line(Died(text)) == "Died: The actor is dead because its worker process has died"



def verdict(last, silent_since=None, now=100.0, timeout=10.0):
    w = Watchdog([], timeout, on_fire=lambda: None)
    w.last, w._silent_since = last, silent_since or {}
    return w._culprit(now)


def test_the_watchdog_blames_the_rank_stuck_longest():
    # Rank 2 hangs in backward; the others wait for it in reduce_grads's collective.
    last = {0: {"step": 7, "phase": "reduce_grads", "elapsed_s": 11.0},
            1: {"step": 7, "phase": "reduce_grads", "elapsed_s": 11.5},
            2: {"step": 7, "phase": "backward", "elapsed_s": 12.0},
            3: {"step": 7, "phase": None, "elapsed_s": 0.0}}
    f = verdict(last)
    assert (f.kind, f.rank, f.phase, f.step) == ("hang", 2, "backward", 7)
    assert "failure.phase_timeout_s=10" in f.message


def test_the_watchdog_blames_the_rank_behind_even_if_others_waited_longer():
    # Rank 0 ran ahead into reduce_grads's collective before rank 2 got stuck in backward.
    last = {0: {"step": 7, "phase": "reduce_grads", "elapsed_s": 11.0},
            1: {"step": 7, "phase": "reduce_grads", "elapsed_s": 9.0},
            2: {"step": 7, "phase": "backward", "elapsed_s": 9.5}}
    f = verdict(last)
    assert (f.rank, f.phase, f.step) == (2, "backward", 7)
    # A rank still a step behind is further behind than one in an earlier phase of a later step.
    last[3] = {"step": 6, "phase": "step", "elapsed_s": 9.9}
    assert verdict(last).rank == 3


def test_the_watchdog_is_quiet_within_the_timeout():
    assert verdict({0: {"step": 1, "phase": "forward", "elapsed_s": 9.0}}) is None


def test_a_rank_that_stops_answering_counts_as_hung():
    f = verdict({1: {"step": 3, "phase": "step", "elapsed_s": 0.5}}, silent_since={1: 85.0})
    assert (f.rank, f.phase, f.step) == (1, "step", 3) and "has not answered for 15s" in f.message


def test_a_rank_still_starting_gets_the_startup_grace():
    # Rank 3 has never answered: its actor is still importing. Not hung within the grace.
    from rayzero.cluster.watchdog import STARTUP_GRACE_S

    assert verdict({}, silent_since={3: 85.0}) is None
    f = verdict({}, silent_since={3: 100.0 - STARTUP_GRACE_S - 1})
    assert f.rank == 3 and f.phase is None and "has not answered" in f.message
    # In setup (building the model, reading its weights): the same grace; in a step, none.
    assert verdict({3: {"step": None, "phase": "setup", "elapsed_s": 15.0}}) is None
    f = verdict({3: {"step": None, "phase": "setup", "elapsed_s": STARTUP_GRACE_S + 1}})
    assert (f.rank, f.phase) == (3, "setup")
    assert verdict({3: {"step": 0, "phase": "gather", "elapsed_s": 15.0}}).rank == 3


def test_world_sizes_and_bad_min_workers():
    assert load_config(None, ELASTIC).world_sizes() == [4, 3, 2]
    assert load_config(None, [*ELASTIC, "sharding.dp_outer=2"]).world_sizes() == [4, 2]
    assert load_config(None, ["cluster.num_workers=4"]).world_sizes() == [4]
    # a smaller world keeps whole context- and expert-parallel groups too
    assert load_config(None, [*ELASTIC, "parallel.cp=2"]).world_sizes() == [4, 2]
    with pytest.raises(ConfigError, match=r"x the data-parallel size and is a multiple of parallel.cp \(2\)"):
        load_config(None, [*ELASTIC, "parallel.cp=2", "cluster.min_workers=3"])
    cfg = load_config(None, ELASTIC)
    mesh = cfg.mesh(3)  # an elastic resize: a new mesh, the same config
    assert mesh.world_size == 3 and cfg.grad_accum_for(mesh) == 4 and cfg.train.global_batch_size == 24
    with pytest.raises(ConfigError, match="cluster.min_workers: 5 exceeds cluster.num_workers"):
        load_config(None, ["cluster.num_workers=4", "cluster.min_workers=5"])
    with pytest.raises(ConfigError, match="cluster.min_workers: no world size from 3 to 3"):
        load_config(None, ["cluster.num_workers=4", "cluster.min_workers=3", "train.global_batch_size=16"])
    with pytest.raises(ConfigError, match="failure.max_restarts"):
        load_config(None, ["failure.max_restarts=-2"])
    assert load_config(None, []).failure.spares == 0
    assert load_config(None, ["failure.spares=2"]).failure.spares == 2
    with pytest.raises(ConfigError, match="failure.spares"):
        load_config(None, ["failure.spares=-1"])


def test_history_rewinds_to_the_resumed_step():
    h = History()
    phases = {p: 0.1 for p in ("gather", "forward", "backward", "reduce_grads", "step", "evaluate")}
    for step in range(6):
        h.record(step, 5.0 - step, 0.2, phases)
        if step % 2:
            h.val_steps.append(step)
            h.val_losses.append(9.0 - step)
    h.rewind(4)
    assert h.steps == [0, 1, 2, 3] and h.losses == [5.0, 4.0, 3.0, 2.0] and len(h.phase_s["step"]) == 4
    assert h.val_steps == [1, 3] and h.val_losses == [8.0, 6.0]
    h.record(4, 1.0, 0.2, phases)
    assert h.steps[-1] == 4 and len(h.step_s) == 5


def test_a_rank_waiting_on_an_upload_that_still_moves_is_not_stuck():
    import time

    from rayzero.workers.rank import Rank

    rank = Rank(load_config(None, []), 0, 1, "unused")
    assert rank.progress() == {"rank": 0, "step": None, "phase": None, "elapsed_s": 0.0, "compiling": False,
                               "finished": None}
    rank._current = ("step", time.monotonic() - 100)

    class Saver:
        waiting, moved_at = True, time.monotonic() - 2

    rank.saver = Saver()
    assert 2 <= rank.progress()["elapsed_s"] < 3
    Saver.waiting = False  # in the phase itself for 100 s
    assert rank.progress()["elapsed_s"] >= 100 and rank.progress()["phase"] == "step"


def test_a_given_up_run_exits_1_with_the_cause(monkeypatch, capsys):
    from rayzero.cluster.failure import TrainingFailed
    from rayzero.jobs import cli, train

    def fails(cfg, progress, startup, ray_start):
        raise TrainingFailed("training stopped after 3 restarts (…): rank 1 died at step 9 (last seen in phase step)")

    monkeypatch.setattr(train, "run_train", fails)
    assert cli.main(["train", "train.steps=2"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("] checking the config, the data and the model")  # the start-up's first line
    assert err[1].startswith("rayzero: training failed: training stopped after 3 restarts")


# -- diagnose: who failed, where --------------------------------------------------------

def test_a_dead_rank_is_named_at_its_step_with_the_phase_it_was_last_seen_in():
    from rayzero.cluster.failure import RANK_DIED, diagnose

    died = RuntimeError("The actor is dead because its worker process has died")
    f = diagnose(RuntimeError("gloo: connection closed by peer"), 0, "backward", dead=[(3, died)],
                 last_seen={3: {"phase": "step", "step": 50}}, step=50, doing="training")
    assert (f.kind, f.rank, f.phase, f.step) == (RANK_DIED, 3, "step", 50)
    assert f.message == "rank 3 died at step 50 (last seen in phase step): " + first_line(died)
    # Seen in the step the driver had queued after the one it was reading: named at that one.
    f = diagnose(RuntimeError("x"), None, None, dead=[(3, died)],
                 last_seen={3: {"phase": "forward", "step": 51}}, step=50, doing="training")
    assert (f.step, f.phase) == (51, "forward") and f.message.startswith("rank 3 died at step 51 ")


def test_a_dead_rank_the_watchdog_has_not_seen_is_named_at_its_step_only():
    from rayzero.cluster.failure import diagnose

    f = diagnose(RuntimeError("x"), None, None, dead=[(1, RuntimeError("gone")), (2, RuntimeError("gone"))],
                 last_seen={}, step=7, doing="training")
    assert f.message.startswith("ranks 1, 2 died at step 7: ") and f.phase is None and f.rank == 1


def test_without_a_dead_rank_the_failing_rank_and_phase_or_what_the_run_was_doing():
    from rayzero.cluster.failure import ERROR, diagnose

    f = diagnose(ValueError("bad"), 2, "forward", dead=[], last_seen={}, step=9, doing="training")
    assert (f.kind, f.message) == (ERROR, "rank 2 failed in phase forward of step 9: ValueError: bad")
    f = diagnose(ValueError("bad"), None, None, dead=[], last_seen={}, step=None, doing="the rendezvous")
    assert f.message == "the rendezvous failed: ValueError: bad"


def test_storage_that_refuses_ends_the_run_at_once_and_a_transient_fault_restarts():
    """A checkpoint upload that fails for good is the storage's failure (which URI, what it said),
    not an error in the training code; credentials or a missing bucket are not restarted again
    and again."""
    import pyarrow as pa

    from rayzero.checkpoint.shards import ShardSaver, UploadFailed, _with_retries
    from rayzero.storage import Storage, StorageSettings

    storage = Storage("s3://bucket/run/step-000002", StorageSettings(endpoint="http://127.0.0.1:9", retries=3))
    calls = []

    def denied():
        calls.append(1)
        raise OSError("When uploading part for key 'x' in bucket 'bucket': AWS Error ACCESS_DENIED during UploadPart")

    with pytest.raises(StorageError, match="uploading to s3://bucket/run/step-000002: When uploading .*ACCESS_DENIED"):
        _with_retries(storage, denied)
    assert len(calls) == 1, "no retry can fix refused credentials"
    writer = object.__new__(ShardSaver)
    writer._error = StorageError("uploading to s3://bucket/run/step-000002: ACCESS_DENIED")
    with pytest.raises(UploadFailed) as e:
        writer._raise()
    assert classify(e.value) == "storage" and str(e.value).startswith("checkpoint upload failed: uploading to s3://")
    refused = Failure("storage", str(e.value), rank=0, step=2)
    d = policy().decide(refused, restarts=0, streak=1, world=4, capacity=4)
    assert d.action == "give_up" and "checkpoint.s3_*" in d.reason and "training code" not in d.reason
    flaky = Failure("storage", "checkpoint upload failed: uploading to s3://b/r: Connection reset by peer", rank=0)
    assert policy().decide(flaky, restarts=0, streak=1, world=4, capacity=4).action == "restart"
    assert not isinstance(pa.ArrowException("x"), StorageError)


def test_the_last_state_says_what_it_does():
    from rayzero.cluster.states import Finishing

    assert Finishing(None, None).doing == "finishing the checkpoint uploads"
    assert Finishing(None, None, True).doing == "finishing the checkpoint uploads and writing the final weights"


# -- the policies, as tables ------------------------------------------------------------------
def scaling(*overrides) -> ScalingPolicy:
    return ScalingPolicy.from_config(load_config(None, [*ELASTIC, *overrides]))


@pytest.mark.parametrize("world, capacity, then", [
    (4, 4, 4),  # room for the same world: the same world
    (4, 3, 3),  # room for 3: shrink to 3
    (4, 2, 2),
    (4, 1, 4),  # room for none of the valid worlds: the same world (placement waits, then shrinks)
    (3, 4, 4),  # already shrunk and the room is back: the configured world again
    (2, 3, 3),
])
def test_scaling_after_a_failure(world, capacity, then):
    assert scaling().after_failure(world, capacity) == then


@pytest.mark.parametrize("world, free, to", [
    (4, 2, None),  # at the configured world: never grows
    (3, 0, None),
    (3, 1, 4),
    (2, 1, 3),
    (2, 2, 4),  # the biggest valid world that fits
])
def test_scaling_grows_back_to_the_biggest_world_that_fits(world, free, to):
    assert scaling().grow_to(world, free) == to


def test_scaling_keeps_to_the_valid_worlds():
    s = scaling("train.global_batch_size=16")  # 16 sequences of 2: 4 and 2 ranks divide them, 3 does not
    assert s.worlds == [4, 2] and s.to_place(4) == [4, 2] and s.to_place(3) == [2]
    assert s.after_failure(4, 3) == 2 and s.grow_to(2, 1) is None and s.grow_to(2, 2) == 4
    fixed = ScalingPolicy.from_config(load_config(None, ["cluster.num_workers=2", "train.global_batch_size=8",
                                                        "train.micro_batch_size=2"]))
    assert not fixed.elastic and fixed.after_failure(2, 1) == 2 and fixed.grow_to(2, 10) is None


@pytest.mark.parametrize("kind, restarts, capacity, action, world", [
    ("rank_died", 0, 4, "restart", 4),
    ("rank_died", 0, 3, "shrink", 3),
    ("hang", 0, 2, "shrink", 2),
    ("storage", 5, 4, "restart", 4),
    ("rank_died", 10, 4, "give_up", 4),  # failure.max_restarts=10
    ("error", 0, 4, "give_up", 4),
])
def test_failure_policy_table(kind, restarts, capacity, action, world):
    cfg = load_config(None, [*ELASTIC, "failure.max_restarts=10"])
    d = FailurePolicy(cfg).decide(Failure(kind, "x"), restarts, 1, world=4, capacity=capacity)
    assert (d.action, d.world_size) == (action, world)


def test_the_failure_policy_asks_the_injected_scaling_policy():
    class Never(ScalingPolicy):
        def after_failure(self, world, capacity):
            return world

    cfg = load_config(None, ELASTIC)
    d = FailurePolicy(cfg, Never(cfg.world_sizes())).decide(Failure("rank_died", "x"), 0, 1, world=4, capacity=2)
    assert (d.action, d.world_size) == ("restart", 4)


@pytest.mark.parametrize("kind, lost, spares, restarts, replaces", [
    ("rank_died", [1], 1, 0, True),
    ("rank_died", [0, 1], 2, 0, True),
    ("rank_died", [0, 1], 1, 0, False),  # a node with more ranks than spares
    ("rank_died", [], 1, 0, False),  # no rank found dead (the graph's error alone)
    ("hang", [1], 1, 0, False),  # the watchdog killed the group
    ("rank_died", [1], 1, 10, False),  # failure.max_restarts=10 reached
])
def test_failure_policy_replaces_only_lost_ranks_that_spares_cover(kind, lost, spares, restarts, replaces):
    cfg = load_config(None, [*ELASTIC, "failure.max_restarts=10"])
    d = FailurePolicy(cfg).replaces(Failure(kind, "x", lost=lost), restarts, world=4, spares=spares)
    assert (d is not None) == replaces
    if replaces:
        assert (d.action, d.world_size, d.delay_s) == ("replace", 4, 0.0) and str(lost[-1]) in d.reason



def test_an_iteration_that_compiles_gets_the_compile_grace():
    """`train.compile`: a rank's first iteration after setup, and its first that evaluates,
    compile (`Compiling`); the watchdog counts them hung only after COMPILE_GRACE_S, where a
    cold compile of a large model's blocks would otherwise read as a hang at every restart."""
    from rayzero.cluster.watchdog import COMPILE_GRACE_S
    from rayzero.workers.compile import Compiling

    c, seen = Compiling(), []
    for plan in ({"step": 0}, {"step": 1}, {"step": 2, "evaluate": True}, {"step": 3, "evaluate": True}):
        c.begin(plan)
        seen.append(c.now)
        assert c.end(plan) == 0.0  # nothing compiled in this process
    assert seen == [True, False, True, False] and not c.now

    compiling = {0: {"step": 0, "phase": "forward", "elapsed_s": COMPILE_GRACE_S - 1, "compiling": True}}
    assert verdict(compiling) is None
    compiling[0]["elapsed_s"] = COMPILE_GRACE_S + 1
    f = verdict(compiling)
    assert f.rank == 0 and f"(failure.phase_timeout_s=10; compiling: at least {COMPILE_GRACE_S:g} s)" in f.message
    assert verdict({0: {"step": 1, "phase": "forward", "elapsed_s": 11.0, "compiling": False}}).rank == 0


def test_a_kernel_left_cut_short_is_deleted_so_that_the_restart_compiles_it(tmp_path):
    """A rank killed while inductor's C++ compiler wrote a kernel leaves a truncated library that
    every later process would load as it is (a crash, or "file too short"); a rank pointing
    inductor at the cache deletes it first, and only it."""
    import _json
    import ctypes
    import shutil

    from rayzero.workers.compile import use_cache_dir

    cache = tmp_path / "compile_cache"
    (cache / "ab").mkdir(parents=True)
    whole = cache / "ab" / "cwhole.main.so"
    shutil.copy(_json.__file__, whole)  # a real library, whole
    data = whole.read_bytes()
    (cache / "ab" / "ccut.main.so").write_bytes(data[: len(data) // 2])  # its header intact, its tables gone
    (cache / "ab" / "cstub.o").write_bytes(data[:10])  # cut before its header
    (cache / "ab" / "cnotes.py").write_bytes(data[:10])  # not a kernel's binary
    try:
        ctypes.CDLL(str(cache / "ab" / "cstub.o"))
    except OSError as e:
        assert "file too short" in str(e)
    assert use_cache_dir(str(cache)) == str(cache)
    assert sorted(p.name for p in (cache / "ab").iterdir()) == ["cnotes.py", "cwhole.main.so"]
    ctypes.CDLL(str(whole))  # the whole one still loads


def test_a_spare_of_a_compiled_run_loads_the_compiler_while_it_waits(monkeypatch):
    """With `train.compile` a spare imports dynamo and inductor in `warm` (1.6 s in a fresh
    process), not in the `setup` the group waits for after a rank is lost."""
    from rayzero.workers import membership
    from rayzero.workers.rank import Rank

    warmed = []
    monkeypatch.setattr(membership, "warm_compiler", warmed.append)
    # and what the warm-up imported leaves the collector's view, last (here: not this process's)
    monkeypatch.setattr(membership, "collect_and_freeze", lambda: warmed.append("frozen"))
    for extra, want in (([], []), (["train.compile=true"], ["inductor"]),
                        (["train.compile=true", "train.compile_backend=aot_eager"], ["aot_eager"])):
        warmed.clear()
        Rank(load_config(None, extra), None, 2, "unused").warm()
        assert warmed == [*want, "frozen"], (extra, warmed)


def test_a_replacement_that_fails_says_its_own_error_and_is_still_the_lost_ranks_failure():
    """The lost rank's actor is still in the group while `Replacing` runs; if the replacement
    itself fails (a survivor that does not leave in time), the message says that error, not a
    second death; the kind stays the lost rank's, so the policy places a fresh group."""
    from types import SimpleNamespace

    from rayzero.cluster.failure import RANK_DIED
    from rayzero.cluster.recovery import Recovering, Replacing
    from rayzero.cluster.states import Live

    class Group:
        actors = [object()] * 4

        def __init__(self, dead):
            self.dead = dead

        def dead_ranks(self):
            return [(r, RuntimeError("The actor died")) for r in self.dead]

    clock = SimpleNamespace(start=lambda failure, at: None, mark=lambda name: None)
    run = SimpleNamespace(record=SimpleNamespace(pids={}, step=12), clock=clock)
    lost = Failure(RANK_DIED, "rank 1 died at step 12", rank=1, step=12, lost=[1])
    stuck = TimeoutError("rank 2 did not leave its process group within 10s")
    f = Recovering(stuck, Replacing(Live(Group([1])), lost)).diagnose(run)
    assert (f.kind, f.lost) == (RANK_DIED, [1]) and f.message == (
        "replacing rank 1 with warm spares failed: TimeoutError: rank 2 did not leave its process group within 10s")
    assert policy().decide(f, 1, 1, 4, 4).action == "restart"
    # another rank dying while the replacement runs is named as the death it is
    f = Recovering(stuck, Replacing(Live(Group([1, 3])), lost)).diagnose(run)
    assert (f.kind, f.lost) == (RANK_DIED, [1, 3]) and f.message.startswith("ranks 1, 3 died")
    # no dead rank left (the spare already took its place): the replacement's own error, as any state's
    f = Recovering(stuck, Replacing(Live(Group([])), lost)).diagnose(run)
    assert f.message == "replacing lost ranks with warm spares failed: TimeoutError: rank 2 did not leave its process group within 10s"
