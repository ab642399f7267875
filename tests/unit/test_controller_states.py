"""The controller's states and its two policies, without Ray: a stand-in cluster whose room can
shrink and come back, groups of stand-in ranks, a dispatcher that fails where a test says, and
checkpoints kept in memory. Each test reads what a run went through (`record.states`), what it
decided and what it recorded."""

import json

import pytest
import ray.exceptions

from rayzero.cluster.controller import Controller
from rayzero.cluster.failure import TrainingFailed
from rayzero.cluster.history import PHASES
from rayzero.cluster.worker_group import PlacementError
from rayzero.config import load_config

BASE = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.seq_len=32", "train.micro_batch_size=2",
        "failure.backoff_s=0", "failure.backoff_max_s=0"]
FIXED = [*BASE, "cluster.num_workers=2", "train.global_batch_size=8", "train.steps=10"]
# 24 sequences of 2 per micro-batch: 4, 3 and 2 ranks divide them
ELASTIC = [*BASE, "cluster.num_workers=4", "cluster.min_workers=2", "train.global_batch_size=24", "train.steps=16"]
EVERY = 4


def loss_at(step: int) -> float:
    """What a step's loss is, whichever group trains it: a resumed run repeats it exactly."""
    return 10.0 / (1 + step)


class Events:
    """What the stand-in cluster does, by step: a rank dies (`faults`), the room changes (`room`)."""

    def __init__(self, capacity: int, faults: dict | None = None, room: dict | None = None):
        self.capacity = capacity
        # step -> the exception raised when that step's results are read (once), or a function of
        # the events that returns it (and may change the room first)
        self.faults = dict(faults or {})
        self.room = dict(room or {})  # step -> the cluster's room from then on
        self.placed = 0  # ranks held by the live group
        self.groups: list[FakeGroup] = []
        self.dead: list[int] = []  # ranks of the live group found dead
        self.spares_die = False  # a spare dies as it is put in
        self.joining_fails: list[int] | None = None  # the first group's rendezvous fails, these ranks dead
        self.last_step: int | None = None  # the last step whose results were read
        self.load_fails: list[int] | None = None  # these ranks die in the next load_checkpoint


class FakeGroup:
    def __init__(self, events: Events, world: int):
        self.events, self.world = events, world
        self.actors = list(range(world))
        self.calls: list[str] = []
        self.joined: list[bool] = []  # each rendezvous's `resuming`
        self.killed = self.closed = False

    def wait_started(self):
        pass

    def rendezvous(self, resuming: bool = False) -> list[dict]:
        self.joined.append(resuming)
        if self.events.joining_fails is not None and self is self.events.groups[0]:
            self.events.dead = self.events.joining_fails
            raise ray.exceptions.ActorDiedError()
        memory = {"compute_params": 4, "main_params": 0, "optimizer": 8, "grads": 4, "frozen_params": 0,
                  "total": 16, "transient_peak": 0}
        return [{"pid": 1000 + r, "rank": r, "params_per_rank": 1, "flops_per_token": 6.0, "device_name": "cpu",
                 "params": {"w": [1]}, "saves_shard": True, "model": {"kind": "gpt"}, "memory": memory,
                 "num_params": 1, "trainable_params": 1, "backend": "gloo", "tp": None, "layout": {},
                 "frozen": [], "initial_values": not resuming} for r in self.actors]

    def call(self, name: str, *args) -> list:
        self.calls.append(name)
        if name == "load_checkpoint" and self.events.load_fails is not None:
            self.events.dead, self.events.load_fails = self.events.load_fails, None
            raise ray.exceptions.ActorDiedError()
        if name == "finish_checkpoints":
            return [[] for _ in self.actors]
        return [{} for _ in self.actors]

    def dead_ranks(self, timeout_s: float = 2.0):
        return [(r, ray.exceptions.ActorDiedError()) for r in self.events.dead if r < len(self.actors)]

    def disconnect(self, lost, timeout_s):
        self.calls.append(f"disconnect {lost}")

    def leave(self, lost, timeout_s):
        self.calls.append(f"leave {lost}")
        return [{"uploads": []} for r in self.actors if r not in lost]

    def take_in(self, rank, spare, world):
        if self.events.spares_die:
            raise ray.exceptions.ActorDiedError()
        self.calls.append(f"take_in {rank}")
        self.events.dead.remove(rank)
        return 2000 + rank

    def vacant_bundle(self):
        return "vacant"

    def kill(self):
        self.killed = True
        self.events.placed = 0
        self.actors = []

    def shutdown(self):
        self.closed = True
        self.kill()


class FakeCluster:
    def __init__(self, events: Events):
        self.events = events
        self.asked: list[int] = []
        self.same_node: list[int] = []  # each placement's run of ranks kept on one node

    def place(self, actor_cls, world, bundle, actor_args, **options):
        self.asked.append(world)
        self.same_node.append(options["same_node"])
        if world > self.events.capacity - self.events.placed:
            raise PlacementError(f"no room for {world}")
        self.events.placed += world
        self.events.dead = []
        group = FakeGroup(self.events, world)
        self.events.groups.append(group)
        return group

    def free(self, bundle, settle_s=0.0) -> int:
        return max(0, self.events.capacity - self.events.placed)

    def placed_ahead(self, actor_cls, world, bundle, strategy="PACK", same_node=1):
        return None  # no placement begun ahead of the run

    def start_spares(self, actor_cls, count, bundle, actor_args):
        return FakeSpares(count, self.events)


class FakeSpares:
    def __init__(self, count, events=None):
        self.ready, self.replenished, self.owed, self.killed = count, [], [], False
        self.events = events

    def __len__(self):
        return self.ready

    def take(self, timeout_s=0.0):
        if not self.ready:
            return None
        self.ready -= 1
        return object()

    def owe(self, home=None):
        self.owed.append(home)

    def settle(self):
        for home in self.owed:  # in the group's calls, to show when
            self.events.groups[-1].calls.append(f"replenish {home} after step {self.events.last_step}")
        self.replenished += self.owed
        self.owed = []

    def forget_owed(self):
        self.owed = []

    def kill(self):
        self.killed = True


class FakeCheckpoints:
    """Commits in memory: a step's checkpoint commits when its results come in."""

    resume_mode = "auto"
    unreadable = False  # every commit damaged: nothing to resume from

    def __init__(self):
        self.commits, self.last_committed, self.best, self.mlflow_run_id = 0, None, None, None
        self.steps: list[int] = []
        self.schedule_steps, self.run = 0, {}

    def plan(self, k, force=False):
        return {"uri": f"mem://step-{k + 1:06d}", "step": k + 1} if force or (k + 1) % EVERY == 0 else None

    def configure(self, infos, run_id):
        pass

    def resume_target(self, params):
        return [] if self.unreadable else [Commit(s) for s in self.steps[::-1][:1]]

    def adopt(self, manifest):
        pass

    def collect(self, step, results, record=None):
        if results[0]["checkpointed"]:
            self.steps.append(step + 1)
            self.commits += 1
            self.last_committed = f"mem://step-{step + 1:06d}"

    def add_uploads(self, uploads):
        pass


class Commit:
    def __init__(self, step):
        self.step, self.uri = step, f"mem://step-{step:06d}"
        self.manifest = {"schedule": {"total_steps": 0}, "early_stopping": None}


class FakeDispatch:
    """Every rank's results of a plan, read in `collect`; a step in `events.faults` raises there once."""

    preparing = None
    events: Events

    def __init__(self, actors, num_microbatches, timeout_s=0.0, staged=False):
        self.world = len(actors)

    def submit(self, plan):
        return plan

    def collect(self, plan, queued=True):
        fault = self.events.faults.pop(plan["step"], None)
        if fault is not None:
            raise fault(self.events) if callable(fault) else fault
        if plan["step"] in self.events.room:
            self.events.capacity = self.events.room.pop(plan["step"])
        self.events.last_step = plan["step"]
        memory = {"compute_params": 4, "main_params": 0, "optimizer": 8, "grads": 4, "frozen_params": 0,
                  "total": 16, "transient_peak": 0}
        return [{"rank": r, "step": plan["step"], "lr": plan["lr"], "loss_sum": loss_at(plan["step"]) / self.world,
                 "tokens": 1.0 / self.world, "aux_loss_sum": None, "grad_norm": 1.0, "skipped": False,
                 "loss_scale": None, "memory": memory, "phase_s": {p: 0.001 for p in PHASES},
                 "uploads": [], "checkpointed": bool(plan["checkpoint"]), "done_at": 0.0}
                for r in range(self.world)]

    def close(self):
        pass


class Tracker:
    uri = run_id = ""
    spilled_to = None

    def __init__(self):
        self.metrics, self.tags, self.rewinds, self.status = {}, {}, [], None

    def log_metrics(self, step, metrics):
        self.metrics.setdefault(step, {}).update(metrics)

    def set_tags(self, tags):
        self.tags.update(tags)

    def rewind(self, step, metrics, tags=()):
        self.rewinds.append(step)

    def finish(self, status="FINISHED"):
        self.status = status


def run(tmp_path, overrides, events: Events, checkpoints=True):
    cfg = load_config(None, overrides)
    dispatch = type("Dispatch", (FakeDispatch,), {"events": events})
    c = Controller(cfg, "data", str(tmp_path), Tracker(), progress=False,
                   checkpoints=FakeCheckpoints() if checkpoints else None,
                   cluster=FakeCluster(events), dispatcher=dispatch, watchdog=lambda actors, on_fire: None)
    return c


def died(step: int) -> Exception:
    """What the dispatcher raises when a rank's process is gone."""
    return ray.exceptions.ActorDiedError()


def lost(*ranks):
    """A fault: these ranks' processes are gone."""
    def fault(events):
        events.dead = list(ranks)
        return ray.exceptions.ActorDiedError()
    return fault


def test_an_unbroken_run_goes_through_each_state_once(tmp_path):
    c = run(tmp_path, FIXED, Events(capacity=2))
    summary = c.fit()
    assert c.record.states == ["PLACE", "BUILD", "RESUME", "TRAIN", "FINISH", "DONE"]
    assert summary["steps"] == 10 and summary["world_size"] == 2 and summary["restarts"] == 0
    assert summary["checkpoints_committed"] == 2 and c.tracker.status == "FINISHED"
    assert [c.tracker.metrics[s]["loss"] for s in range(10)] == [loss_at(s) for s in range(10)]
    assert c.state == "DONE"


def test_a_lost_rank_restarts_the_group_from_the_last_commit(tmp_path):
    events = Events(capacity=2, faults={6: died(6)})
    c = run(tmp_path, FIXED, events)
    summary = c.fit()
    assert c.record.states == ["PLACE", "BUILD", "RESUME", "TRAIN", "RECOVER",
                               "PLACE", "BUILD", "RESUME", "TRAIN", "FINISH", "DONE"]
    (f,) = c.failures
    assert (f.kind, f.decision, f.world_size, f.step) == ("rank_died", "restart", 2, 6)
    assert events.groups[0].killed and not events.groups[0].closed, "a failed group is killed, not closed"
    assert events.groups[1].calls[:2] == ["load_checkpoint", "apply_checkpoint"]
    assert events.groups[0].joined == [False] and events.groups[1].joined == [True], \
        "set up for the commit it loads: no initial values for the trainable parameters"
    assert c.tracker.rewinds == [4] and summary["resumed_from"] is None and summary["steps"] == 10
    assert [r["step"] for r in c.history.rows] == list(range(10)), "steps 4 and 5 trained again, once each"
    on_disk = [json.loads(line)["step"] for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert on_disk == list(range(10)), "history.jsonl: one row per step as well"
    assert c.tracker.tags["resumed_from"] == "mem://step-000004"
    assert set(f.timings) >= {"diagnose_s", "teardown_s", "backoff_s", "placement_s", "rendezvous_s", "load_s",
                              "graph_s", "first_step_s", "total_s"}
    assert "recovery_s" in c.tracker.metrics[4]


def test_a_group_set_up_for_a_commit_that_none_of_loads_is_set_up_again_with_initial_values(tmp_path):
    events = Events(capacity=2)
    c = run(tmp_path, FIXED, events)

    def dies_and_every_commit_is_damaged(ev):
        c.checkpoints.unreadable = True
        return ray.exceptions.ActorDiedError()
    events.faults[6] = dies_and_every_commit_is_damaged
    summary = c.fit()
    assert events.groups[1].joined == [True, False], "set up for the commit, then again from the initial values"
    assert "load_checkpoint" not in events.groups[1].calls
    assert summary["steps"] == 10 and [r["step"] for r in c.history.rows] == list(range(10))


def test_the_cluster_shrinking_shrinks_the_run_and_its_return_grows_it_back_at_a_commit(tmp_path):
    def node_lost(events):  # a rank dies with its node: room for 3 ranks is left
        events.capacity = 3
        return died(6)

    events = Events(capacity=4, faults={6: node_lost}, room={9: 4})  # the node is back at step 9
    c = run(tmp_path, ELASTIC, events)
    summary = c.fit()
    (f,) = c.failures
    assert (f.decision, f.world_size) == ("shrink", 3)
    # back at 3 ranks from the step-4 commit; the room returns during step 9; the next commit
    # (after step 11) is where the run regroups at 4
    assert c.resizes == [{"step": 12, "from": 3, "to": 4}]
    assert c.record.states == ["PLACE", "BUILD", "RESUME", "TRAIN", "RECOVER",
                               "PLACE", "BUILD", "RESUME", "TRAIN", "FINISH", "RESIZE",
                               "PLACE", "BUILD", "RESUME", "TRAIN", "FINISH", "DONE"]
    assert [g.world for g in events.groups] == [4, 3, 4] and events.groups[1].closed, "closed politely"
    assert summary["world_size"] == 4 and summary["steps"] == 16 and summary["resizes"] == c.resizes
    assert [c.tracker.metrics[s]["world_size"] for s in (0, 4, 12)] == [4, 3, 4]


def test_giving_up_names_the_cause_and_the_commit_to_resume_from(tmp_path):
    events = Events(capacity=2, faults={6: died(6)})
    c = run(tmp_path, [*FIXED, "failure.max_restarts=0"], events)
    with pytest.raises(TrainingFailed) as e:
        c.fit()
    assert "failure.max_restarts=0 reached" in str(e.value) and "mem://step-000004" in str(e.value)
    assert c.tracker.status == "FAILED" and events.groups[0].killed
    assert c.state == "TRAIN", "the run ended in the state that failed"


def test_an_error_in_the_training_code_is_not_retried(tmp_path):
    events = Events(capacity=2, faults={3: ValueError("shapes do not match")})
    c = run(tmp_path, FIXED, events)
    with pytest.raises(TrainingFailed, match="training code"):
        c.fit()
    assert [f.decision for f in c.failures] == ["give_up"] and len(events.groups) == 1


def test_the_very_first_placement_failing_is_the_requests_fault(tmp_path):
    c = run(tmp_path, FIXED, Events(capacity=1))
    with pytest.raises(PlacementError, match="no room for 2"):
        c.fit()
    assert c.record.states == ["PLACE", "RECOVER"] and not c.failures


def test_a_failure_while_building_is_recovered_and_said_as_such(tmp_path):
    events = Events(capacity=2)
    events.joining_fails = []
    c = run(tmp_path, FIXED, events)
    c.fit()
    (f,) = c.failures
    assert f.step is None and "building the model on the ranks failed" in f.message
    assert c.record.states[:6] == ["PLACE", "BUILD", "RECOVER", "PLACE", "BUILD", "RESUME"]


def test_elastic_placement_takes_the_largest_world_the_cluster_holds(tmp_path):
    events = Events(capacity=3)
    c = run(tmp_path, ELASTIC, events, checkpoints=False)
    c.fit()
    assert c.cluster.asked == [4, 3] and c.world == 3


def test_a_tensor_parallel_group_is_placed_on_one_node(tmp_path):
    """The placement asks the mesh which ranks share a node (its `node` role: a TP group)."""
    c = run(tmp_path, [*FIXED, "parallel.tp=2", "train.global_batch_size=4"], Events(capacity=2), checkpoints=False)
    c.fit()
    assert c.cluster.same_node == [2] and c.world == 2


def test_a_warm_spare_takes_a_lost_ranks_place_and_the_other_ranks_stay(tmp_path):
    events = Events(capacity=2, faults={6: lost(1)})
    c = run(tmp_path, [*FIXED, "failure.spares=1"], events)
    summary = c.fit()
    assert c.record.states == ["PLACE", "BUILD", "RESUME", "TRAIN", "RECOVER", "REPLACE",
                               "BUILD", "RESUME", "TRAIN", "FINISH", "DONE"]
    (f,) = c.failures
    assert (f.kind, f.decision, f.lost, f.world_size) == ("rank_died", "replace", [1], 2)
    (group,) = events.groups
    assert group.closed, "the one group, closed politely at the end: never killed"
    assert group.calls[:4] == ["disconnect [1]", "leave [1]", "take_in 1", "load_checkpoint"]
    assert c.spares.replenished == ["vacant"] and c.spares.killed, "replenished in the lost rank's bundle"
    # once the group has trained its first step again: a spare's start would slow the recovery's
    assert group.calls[4:6] == ["apply_checkpoint", f"replenish vacant after step {c.record.start_step}"]
    assert summary["replacements"] == [{"rank": 1, "step": 6, "pid": 2001}] and summary["restarts"] == 1
    assert [r["step"] for r in c.history.rows] == list(range(10))
    assert {"teardown_s", "replacement_s", "rendezvous_s", "load_s", "total_s"} <= set(f.timings)
    assert "backoff_s" not in f.timings and "placement_s" not in f.timings


def test_a_node_with_more_ranks_than_spares_restarts_the_group(tmp_path):
    events = Events(capacity=3, faults={6: lost(0, 1)})
    c = run(tmp_path, [*FIXED, "failure.spares=1"], events)
    c.fit()
    (f,) = c.failures
    assert (f.decision, f.lost) == ("restart", [0, 1]) and len(events.groups) == 2 and events.groups[0].killed


def test_a_spare_that_dies_as_it_is_put_in_falls_back_to_a_restart(tmp_path):
    events = Events(capacity=3, faults={6: lost(1)})
    events.spares_die = True
    c = run(tmp_path, [*FIXED, "failure.spares=1"], events)
    c.fit()
    assert [f.decision for f in c.failures] == ["replace", "restart"]
    assert c.record.states[4:8] == ["RECOVER", "REPLACE", "RECOVER", "PLACE"]
    assert events.groups[0].killed and len(events.groups) == 2 and c.history.steps[-1] == 9


def test_a_group_that_fails_after_a_spare_came_in_restarts_without_the_spare_it_owed(tmp_path):
    """The spare that replaced rank 1 is replenished only once the group has trained again;
    the group fails first (rank 0 dies in the load), so a fresh group is placed, and the
    vacant bundle of the killed group is not used."""
    def rank_1_lost_then_rank_0_in_the_load(events):
        events.load_fails = [0]
        return lost(1)(events)

    events = Events(capacity=3, faults={6: rank_1_lost_then_rank_0_in_the_load})
    c = run(tmp_path, [*FIXED, "failure.spares=1"], events)
    c.fit()
    assert [f.decision for f in c.failures] == ["replace", "restart"]
    assert c.record.states[4:10] == ["RECOVER", "REPLACE", "BUILD", "RESUME", "RECOVER", "PLACE"]
    assert events.groups[0].killed and len(events.groups) == 2 and c.history.steps[-1] == 9
    assert c.spares.replenished == [] and c.spares.owed == []


def test_a_rank_lost_while_the_group_joins_is_not_replaced_but_restarted(tmp_path):
    """The other ranks may wait on it in the rendezvous, where nothing gives up soon."""
    events = Events(capacity=3)
    events.joining_fails = [1]
    c = run(tmp_path, [*FIXED, "failure.spares=1"], events)
    c.fit()
    (f,) = c.failures
    assert (f.lost, f.decision) == ([1], "restart") and len(events.groups) == 2
