"""Failures on a real Ray cluster (gloo), at the smallest world that shows each: ranks killed,
a rank hung, the storage upload cut short, the controller killed, resources withdrawn and
returned. Each run carries on by itself and ends with the parameters of one uninterrupted run,
made once for all of them (`reference`)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray import cloudpickle
from safetensors.torch import load_file

from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.controller import Controller
from rayzero.cluster.failure import TrainingFailed
from rayzero.config import load_config
from rayzero.workers.actor import RankShim, rank_actor
from tests.conftest import cli_in_process
from tests.e2e.conftest import BIN, leftovers
from tests.e2e.faults import (EVERY, RUN, STEPS, STRIKE, NullTracker, OnceMarker, committed, controller_run,
                              rank_pids, shut_down, wait_for, weights_equal)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HANG = 2 * EVERY + 3  # after the second commit, made by the group that came back

class ExitsOnly:
    """A rank actor's `until_exit` (RankShim's own), without a rank to build."""

    until_exit = RankShim.until_exit

    def pid(self) -> int:
        return os.getpid()


def test_a_rank_process_ending_ends_the_drivers_nap_at_once(ray_cluster):
    """The compiled graph's driver naps through an iteration on each rank's `until_exit` call
    (`dispatch.rest`): the nap runs its course while the ranks live, and ends when one of their
    processes does, instead of at the iteration's expected end."""
    from rayzero.cluster.dispatch import rest

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    ray.init(address=ray_cluster, logging_level="ERROR")
    try:
        cls = ray.remote(num_cpus=0, concurrency_groups={"exit": 1})(ExitsOnly)
        actors = [cls.remote() for _ in range(2)]
        pid = ray.get(actors[1].pid.remote())
        exits = [a.until_exit.remote() for a in actors]
        assert rest(exits, 0.5) is False, "every rank lives: the nap runs its course"
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        assert rest(exits, 60.0) is True, "a rank's process ended: the nap ends with it (not after 60 s)"
        ray.kill(actors[0])
    finally:
        ray.shutdown()


def cli_args(tmp: Path, data: str, *extra: str) -> list[str]:
    return ["train", "--no-progress", "--summary-json", str(tmp / "s.json"), f"data.path={data}", *RUN,
            f"train.output_dir={tmp / 'runs'}", f"train.save_final={tmp / 'final.safetensors'}", *extra]


def run_and_kill(tmp: Path, data: str, address: str, seed: int):
    """The CLI, with one rank process SIGKILLed at a random moment after the first commit, then,
    once the group it came back as has committed again, every rank process at once."""
    proc = subprocess.Popen([str(BIN / "rayzero"), *cli_args(tmp, data, f"cluster.address={address}")],
                            cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "token"})
    root = tmp / "runs" / "checkpoints"
    wait_for(lambda: committed(root), 120, "the first commit")
    rng = random.Random(seed)
    time.sleep(rng.uniform(0.0, 0.3))  # well within the steps to go
    first = rank_pids()
    os.kill(rng.choice(first), signal.SIGKILL)
    commits = committed(root)
    wait_for(lambda: len(rank_pids()) == 2 and set(rank_pids()).isdisjoint(first)
             and len(committed(root)) > len(commits), 120, "a commit by the replacement group")
    for pid in rank_pids():
        os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_killed_ranks_are_replaced_and_the_result_is_bitwise_the_same(tmp_path, ray_cluster, small_dataset,
                                                                      reference):
    code, out, err = run_and_kill(tmp_path, small_dataset, ray_cluster, seed=1)
    assert code == 0, err[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["restarts"] == 2 and [f["kind"] for f in s["failures"]] == ["rank_died", "rank_died"], s["failures"]
    assert [f["decision"] for f in s["failures"]] == ["restart", "restart"] and s["world_size"] == 2
    assert all("died" in f["message"] for f in s["failures"]) and "restart 1:" in out and "restart 2:" in out
    assert "failure (rank_died): " in err, "the controller's warnings reach the terminal as they happen"
    assert "A worker died or was killed" not in out + err, "said once, in rayzero's words, not Ray's too"
    assert weights_equal(tmp_path / "final.safetensors", reference.weights)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(s["mlflow_tracking_uri"])
    run = client.get_run(s["mlflow_run_id"])
    assert run.data.metrics["restarts"] == s["restarts"]
    assert run.data.tags["failure.last_cause"] == "rank_died"
    for n in (1, 2):
        assert "died" in run.data.tags[f"failure.{n}"] and "-> restart at 2 ranks" in run.data.tags[f"failure.{n}"]
    assert run.info.status == "FINISHED"
    # The steps trained again after each restart replaced their first points: one a step.
    assert sorted(m.step for m in client.get_metric_history(s["mlflow_run_id"], "loss")) == list(range(STEPS))
    assert leftovers(ray_cluster) == ([], [])


class DiesDuringSecondUploadThenHangs(OnceMarker):
    """Rank 1 dies as its second commit's shard upload starts (step 2 x EVERY); in the group that
    comes back, it hangs inside backward between that commit and the next."""

    def step(self, prev):
        out = super().step(prev)
        where = self.rank.plan.get("checkpoint")
        if where and where["step"] == 2 * EVERY and self.rank.mesh.rank == 1 and self._first_time("die"):
            os._exit(1)  # its second commit's shard upload has just started
        return out

    def backward(self, prev):
        if self.rank.plan["step"] == HANG and self.rank.mesh.rank == 1 and self._first_time("hang"):
            self.rank.strategy.backward = lambda *args, **kwargs: time.sleep(3600)  # stuck inside the phase
        return super().backward(prev)


class AlwaysDiesBetweenCommits(RankShim):
    def step(self, prev):
        if self.rank.plan["step"] == STRIKE and self.rank.mesh.rank == 1:
            os._exit(1)
        return super().step(prev)


def test_a_rank_killed_during_an_upload_then_a_hung_rank_both_resume(tmp_path, ray_cluster, small_dataset,
                                                                     reference):
    controller, error = controller_run(tmp_path, ray_cluster, small_dataset, DiesDuringSecondUploadThenHangs,
                                       "failure.phase_timeout_s=4")
    assert error is None, error
    died, hung = controller.failures
    assert died.kind == "rank_died" and died.rank == 1
    assert died.step in (2 * EVERY - 1, 2 * EVERY), "found at the checkpoint step or the one queued after it"
    # The watchdog: the rank stuck inside backward, named with its phase and step.
    assert (hung.kind, hung.rank, hung.phase, hung.step) == ("hang", 1, "backward", HANG), hung
    assert "failure.phase_timeout_s=4" in hung.message
    assert controller.summary_["restarts"] == 2 and [f["kind"] for f in controller.summary_["failures"]] == [
        "rank_died", "hang"]
    # The second commit's upload never finished: the group came back from the first commit; after
    # the hang, from the second, which the second group made.
    resumed = [t["resumed_from"] for t in controller.tracker.tag_updates if "resumed_from" in t]
    assert [r.rpartition("/")[2] for r in resumed] == [f"step-{EVERY:06d}", f"step-{2 * EVERY:06d}"]
    assert controller.tracker.rewinds == [EVERY, 2 * EVERY], "the steps trained again supersede their first points"
    assert weights_equal(tmp_path / "final.safetensors", reference.weights)
    assert leftovers(ray_cluster) == ([], [])


def test_an_error_in_the_first_step_fails_the_run_with_it(train_here, small_dataset):
    """The model's own forward raising on every rank at step 0, while the driver has the next
    step queued (the ranks begin it on the error): the run ends with the error, not a wait on the
    step that will never finish (it waited the dispatch's 600 s before)."""
    code, _, err, _ = train_here(f"data.path={small_dataset}", "model.kind=module",
                                 "model.factory=tests.models:RaisesInTraining", "train.steps=3", "train.seq_len=32",
                                 "checkpoint.dir=", "tracking.enabled=false")
    assert code == 1, err[-2000:]
    assert "training failed at step 0: ValueError: the model's own forward failed" in err
    assert "the error is in the training code, not a lost resource" in err


def test_giving_up_after_max_restarts_names_the_cause_and_leaves_nothing(tmp_path, ray_cluster, small_dataset):
    controller, error = controller_run(tmp_path, ray_cluster, small_dataset, AlwaysDiesBetweenCommits,
                                       "failure.max_restarts=1")
    assert isinstance(error, TrainingFailed), error
    text = str(error)
    assert "training stopped after 1 restart (failure.max_restarts=1 reached)" in text
    # Read at the step the driver was reading, or at the one it had queued after it.
    assert f"rank 1 died at step {STRIKE}" in text or f"rank 1 died at step {STRIKE - 1}" in text, text
    assert f"step-{EVERY:06d}" in text and "run the same command again" in text.lower()
    assert len(controller.failures) == 2 and controller.tracker.status == "FAILED"
    assert [f.decision for f in controller.failures] == ["restart", "give_up"]
    assert controller.tracker.metrics[STRIKE]["restarts"] == 1
    assert leftovers(ray_cluster) == ([], [])


def test_the_controller_killed_and_the_command_rerun_resumes(tmp_path, ray_cluster, small_dataset, reference, capsys,
                                                             monkeypatch):
    """The controller's process SIGKILLed after the first commit; the same command run again (by
    the CLI's `main` here: the process that is killed is the one whose death is tested) resumes
    from the commit and ends on the unbroken run's weights."""
    args = cli_args(tmp_path, small_dataset, f"cluster.address={ray_cluster}", "tracking.enabled=false")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    proc = subprocess.Popen([str(BIN / "rayzero"), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: committed(tmp_path / "runs" / "checkpoints"), 120, "the first commit")
    proc.kill()  # SIGKILL: no cleanup runs in the driver
    proc.wait()
    # Ray ends a dead driver's actors and placement groups by itself.
    wait_for(lambda: not rank_pids(), 60, "the killed job's ranks to go")
    wait_for(lambda: leftovers(ray_cluster) == ([], []), 60, "the killed job's placement group to go")
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, *args)
    assert code == 0, err[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["start_step"] >= EVERY and s["resumed_from"].endswith(f"step-{s['start_step']:06d}")
    assert weights_equal(tmp_path / "final.safetensors", reference.weights)


class DiesOnceAtStep3(OnceMarker):
    """Rank 1 dies once, at step 3 (after the step-2 commit)."""

    def step(self, prev):
        if self.rank.plan["step"] == 3 and self.rank.mesh.rank == 1 and self._first_time("die"):
            os._exit(1)
        return super().step(prev)


# tp 2 x dp 2, ZeRO-3 with sequence parallelism, dropout, a vocabulary split with padding; a
# constant learning rate, so that 2 steps and then 4 follow the schedule of 4 steps.
TP = ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.tp=2", "parallel.sequence_parallel=true",
      "sharding.strategy=optim_grads_params", "model.dropout=0.1", "model.vocab_size=259", "optim.schedule=constant",
      "optim.warmup_steps=0", "checkpoint.every_steps=2"]


def test_a_tensor_parallel_run_restarts_after_a_lost_rank_and_resumes_from_its_command_bitwise(
        tmp_path, ray_cluster, small_dataset, train_here):
    """tp 2 x dp 2 with dropout, 4 steps three ways, all bit for bit the same weights: with rank
    1 killed at step 3, the controller rebuilding the group from the step-2 commit (its whole
    tensors against the ranks' whole shapes); unbroken, through `rayzero train`; and through
    `rayzero train` again on a checkpoint directory holding the unbroken run's step-2 commit
    alone (as a run stopped there leaves it), the same command run again to 4, on the rank
    processes the unbroken run kept. The dropout masks of steps 2 to 4 are drawn again alike,
    whatever came before them. The command run again recomputes its activations (`full`, its
    ZeRO-3 units gathered again inside the recompute): a recompute draws the masks its first
    forward drew, so the weights are bitwise those of the runs that recompute nothing. (Every
    mode, `selective` too, bitwise for three models: tests/dist/test_activation_checkpointing.py;
    a recompute here costs 1-3 s a step, 4 ranks sharing 2 cores, so one run of 2 steps shows it.)"""
    (tmp_path / "struck").mkdir()
    struck, error = controller_run(tmp_path / "struck", ray_cluster, small_dataset, DiesOnceAtStep3, *TP,
                                   "train.steps=4")
    assert error is None, error
    (failure,) = struck.failures
    assert (failure.kind, failure.rank, failure.decision) == ("rank_died", 1, "restart")
    resumed = [t["resumed_from"] for t in struck.tracker.tag_updates if "resumed_from" in t]
    assert [r.rpartition("/")[2] for r in resumed] == ["step-000002"]

    straight = tmp_path / "straight"
    code, _, err, _ = train_here(f"data.path={small_dataset}", *RUN, *TP, "train.steps=4", "tracking.enabled=false",
                                 f"checkpoint.dir={straight}", f"train.save_final={tmp_path / 'straight.safetensors'}",
                                 summary="straight.json")
    assert code == 0, err[-3000:]
    assert weights_equal(tmp_path / "struck" / "final.safetensors", tmp_path / "straight.safetensors")

    stopped = tmp_path / "ck"
    shutil.copytree(straight / "step-000002", stopped / "step-000002")
    code, _, err, again = train_here(f"data.path={small_dataset}", *RUN, *TP, "train.steps=4",
                                     f"checkpoint.dir={stopped}", "model.activation_checkpointing=full",
                                     "tracking.enabled=false", f"train.save_final={tmp_path / 'rerun.safetensors'}")
    assert code == 0, err[-3000:]
    assert f"rayzero: resuming from {stopped / 'step-000002'} at step 2 of 4" in err
    assert again["start_step"] == 2 and again["steps"] == 2 and again["vocab_parallel"]
    assert "taking the 4 ranks the last run kept" in err, "the unbroken run's rank processes serve the rerun"
    assert weights_equal(tmp_path / "rerun.safetensors", tmp_path / "straight.safetensors")
    assert load_file(tmp_path / "rerun.safetensors")["wte.weight"].shape == (259, 64), "no padding row"
    # Nothing left on the cluster but the ranks the rerun kept: `leaves_nothing_on_the_cluster`.


ELASTIC = ["cluster.min_workers=1", "cluster.placement_timeout_s=3"]


class WaitsAtOneRankForTheNode(OnceMarker):
    """Alone (the group shrunk to 1 rank), the rank holds a step between two commits until the test says the
    lost node is back (`marker`-node-back): a node takes seconds to start on 2 busy cores, and
    the 1-rank run would otherwise finish its remaining checkpoints, where it may grow, first."""

    def step(self, prev):
        if self.rank.mesh.world_size == 1 and self.rank.plan["step"] % EVERY == 4 and self._first_time("hold"):
            wait_for(lambda: os.path.exists(f"{self.marker}-node-back"), 40, "the node to come back")
        return super().step(prev)


def test_elastic_shrinks_when_a_node_is_lost_and_grows_back_when_it_returns(tmp_path, small_dataset, reference):
    """A 2-node cluster (1 CPU + 1 CPU) of 2 ranks loses one node after the first commit: the
    run goes on at 1 rank (8 sequences = 1 x 4 x 2), resharded from the commit; the node comes
    back and the run grows to 2 ranks at the next checkpoint. The global batch never changes,
    so the losses follow the unbroken 2-rank run's (`reference`, on the session's cluster)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    spare = cluster.add_node(num_cpus=1)
    try:
        events = []

        def chaos(controller):
            wait_for(lambda: committed(tmp_path / "runs" / "checkpoints"), 120, "the first commit")
            cluster.remove_node(spare, allow_graceful=False)
            events.append(("removed", time.time()))
            wait_for(lambda: controller.world == 1 and controller.history.steps
                     and controller.history.steps[-1] > EVERY + 2, 120, "training at 1 rank")
            cluster.add_node(num_cpus=1)
            # Free in the driver's view of the cluster, where the controller looks at a checkpoint.
            wait_for(lambda: ray.available_resources().get("CPU", 0) >= 1, 30, "the node's CPU")
            events.append(("added", time.time()))
            Path(f"{WaitsAtOneRankForTheNode.marker}-node-back").touch()

        controller, error = elastic_run(tmp_path, cluster, small_dataset, chaos)
        assert error is None, error
    finally:
        shut_down(cluster)
    assert [e for e, _ in events] == ["removed", "added"]
    assert controller.failures[-1].world_size == 1, controller.failures
    assert "shrink" in [f.decision for f in controller.failures]
    (grew,) = controller.resizes
    assert grew["from"] == 1 and grew["to"] == 2 and grew["step"] % EVERY == 0
    assert controller.world == 2
    got = {k: v["loss"] for k, v in controller.tracker.metrics.items() if "loss" in v}
    assert got.keys() == reference.losses.keys() == set(range(STEPS))
    # fp32 sums in another order at 1 rank: equal to within fp32 rounding, compounded over steps
    assert [got[k] for k in sorted(got)] == pytest.approx([reference.losses[k] for k in sorted(got)], rel=1e-4)
    final, ref = load_file(tmp_path / "final.safetensors"), load_file(reference.weights)
    # The weights as a whole. (Single tensors may differ more: the attention key bias has an
    # exactly-zero gradient up to rounding, which Adam turns into full ±lr steps either way.)
    diff = torch.cat([(final[k] - ref[k]).flatten() for k in ref]).norm()
    assert (diff / torch.cat([ref[k].flatten() for k in ref]).norm()).item() < 1e-4


def elastic_run(tmp: Path, cluster, data: str, chaos):
    """The controller trains in a thread, its ranks `WaitsAtOneRankForTheNode`;
    `chaos(controller)` runs here meanwhile (adding a node must happen on the main thread)."""
    for module in (__name__, OnceMarker.__module__):  # workers cannot import tests/
        cloudpickle.register_pickle_by_value(sys.modules[module])
    WaitsAtOneRankForTheNode.marker = str(tmp / "fault-happened")
    actor = rank_actor(type("Elastic", (WaitsAtOneRankForTheNode, RankShim), {}))
    cfg = load_config(None, [*RUN, *ELASTIC, f"data.path={data}", f"train.output_dir={tmp / 'runs'}",
                             f"train.save_final={tmp / 'final.safetensors'}"])
    ray.init(address=cluster.address, logging_level="ERROR")
    errors = []

    def fit():
        try:
            controller.fit()
        except Exception as e:
            errors.append(e)

    try:
        controller = Controller(cfg, data, str(tmp), NullTracker(), progress=False, actor_cls=actor,
                                checkpoints=Checkpoints(cfg))
        thread = threading.Thread(target=fit, daemon=True)
        thread.start()
        chaos(controller)
        thread.join(timeout=300)
        assert not thread.is_alive(), "training did not finish"
    finally:
        ray.shutdown()
    return controller, (errors or [None])[0]
