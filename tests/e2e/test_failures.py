"""Failures at 4 ranks on a real Ray cluster (gloo): ranks killed, a rank hung, the storage
upload cut short, the controller killed, resources withdrawn and returned. Each run carries on
by itself and ends with the parameters an uninterrupted run has."""

import json
import os
import random
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
from tests.e2e.conftest import BIN, leftovers, run_cli

pytestmark = pytest.mark.e2e

# 4 ranks on the 2-CPU test cluster; ~40 ms per step, a commit every 40 steps.
RUN = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64",
       "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2",
       "cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "train.steps=240",
       "checkpoint.every_steps=40", "failure.backoff_s=0.2"]


def rank_pids() -> list[int]:
    """PIDs of the live rank actor processes on this machine (Ray names them ray::RankShim…)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "cmdline").read_bytes().startswith(b"ray::") and b"RankShim" in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return sorted(pids)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def committed(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("step-*/manifest.json"))


def weights_equal(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def cli_args(tmp: Path, data: str, *extra: str) -> list[str]:
    return ["train", "--no-progress", "--summary-json", str(tmp / "s.json"), f"data.path={data}", *RUN,
            f"train.output_dir={tmp / 'runs'}", f"train.save_final={tmp / 'final.safetensors'}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ray_cluster, small_dataset) -> Path:
    """The uninterrupted run's final weights."""
    tmp = tmp_path_factory.mktemp("reference")
    r = run_cli(*cli_args(tmp, small_dataset, f"cluster.address={ray_cluster}", "tracking.enabled=false"), cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "final.safetensors"


def run_and_kill(tmp: Path, data: str, address: str, how_many: int, seed: int):
    """The CLI, with `how_many` rank processes SIGKILLed at a random moment after the first commit."""
    proc = subprocess.Popen([str(BIN / "rayzero"), *cli_args(tmp, data, f"cluster.address={address}")],
                            cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "token"})
    wait_for(lambda: committed(tmp / "runs" / "checkpoints"), 120, "the first commit")
    rng = random.Random(seed)
    time.sleep(rng.uniform(0.0, 2.0))
    victims = rng.sample(rank_pids(), how_many)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.mark.parametrize("how_many", [1, 2], ids=["one-rank", "two-ranks"])
def test_killed_ranks_are_replaced_and_the_result_is_bitwise_the_same(tmp_path, ray_cluster, small_dataset,
                                                                      reference, how_many):
    code, out, err = run_and_kill(tmp_path, small_dataset, ray_cluster, how_many, seed=how_many)
    assert code == 0, err[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["restarts"] >= 1 and s["failures"][0]["kind"] == "rank_died", s["failures"]
    assert s["failures"][0]["decision"] == "restart" and s["world_size"] == 4
    assert "died" in s["failures"][0]["message"] and "restart 1:" in out
    assert weights_equal(tmp_path / "final.safetensors", reference)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(s["mlflow_tracking_uri"])
    run = client.get_run(s["mlflow_run_id"])
    assert run.data.metrics["restarts"] == s["restarts"]
    assert run.data.tags["failure.last_cause"] == "rank_died"
    assert "died" in run.data.tags["failure.1"] and "-> restart at 4 ranks" in run.data.tags["failure.1"]
    assert run.info.status == "FINISHED"
    assert leftovers(ray_cluster) == ([], [])


class OnceMarker:
    """A fault that happens once per test, whichever group of rank actors reaches it first:
    the marker file says it already has."""

    marker: str = ""

    def _first_time(self) -> bool:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return False
        os.close(fd)
        return True


class DiesDuringSecondUpload(OnceMarker):
    def step(self, prev):
        out = super().step(prev)
        where = self.rank.plan.get("checkpoint")
        if where and where["step"] == 80 and self.rank.topo.rank == 1 and self._first_time():
            os._exit(1)  # its step-80 shard upload has just started
        return out


class HangsInBackward(OnceMarker):
    def backward(self, prev):
        if self.rank.plan["step"] == 100 and self.rank.topo.rank == 2 and self._first_time():
            self.rank.strategy.backward = lambda *args, **kwargs: time.sleep(3600)  # stuck inside the phase
        return super().backward(prev)


class AlwaysDiesAtStep50(RankShim):
    def step(self, prev):
        if self.rank.plan["step"] == 50 and self.rank.topo.rank == 3:
            os._exit(1)
        return super().step(prev)


class NullTracker:
    """Keeps what the controller logs, for the assertions."""

    uri = run_id = ""
    spilled_to = None

    def __init__(self):
        self.metrics, self.tags = {}, {}

    def log_metrics(self, step, metrics):
        self.metrics.setdefault(step, {}).update(metrics)

    def set_tags(self, tags):
        self.tags.update(tags)

    def finish(self, status="FINISHED"):
        self.status = status


def controller_run(tmp: Path, address: str, data: str, actor: type, *extra: str):
    """The controller in this process with a fault-injecting rank class; returns it after fit
    (or after fit raised: the exception is returned too)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    actor.marker = str(tmp / "fault-happened")
    cfg = load_config(None, [*RUN, f"data.path={data}", f"train.output_dir={tmp / 'runs'}",
                             f"train.save_final={tmp / 'final.safetensors'}", *extra])
    ray.init(address=address, logging_level="ERROR")
    error = None
    try:
        controller = Controller(cfg, data, str(tmp), NullTracker(), progress=False,
                                actor_cls=rank_actor(type(actor.__name__, (actor, RankShim), {})),
                                checkpoints=Checkpoints(cfg))
        try:
            controller.summary_ = controller.fit()
        except Exception as e:
            error = e
    finally:
        ray.shutdown()
    return controller, error


def test_a_rank_killed_during_an_upload_resumes_from_the_commit_before(tmp_path, ray_cluster, small_dataset,
                                                                         reference):
    controller, error = controller_run(tmp_path, ray_cluster, small_dataset, DiesDuringSecondUpload)
    assert error is None, error
    (failure,) = controller.failures
    assert failure.kind == "rank_died" and failure.rank == 1
    assert failure.step in (79, 80), "found at the checkpoint step or the one queued after it"
    # Step 80's upload never finished: the group came back from step 40's commit.
    assert controller.tracker.tags["resumed_from"].endswith("step-000040")
    assert weights_equal(tmp_path / "final.safetensors", reference)
    assert leftovers(ray_cluster) == ([], [])


def test_a_hung_rank_is_caught_by_the_watchdog(tmp_path, ray_cluster, small_dataset, reference):
    controller, error = controller_run(tmp_path, ray_cluster, small_dataset, HangsInBackward,
                                       "failure.phase_timeout_s=4")
    assert error is None, error
    (failure,) = controller.failures
    assert (failure.kind, failure.rank, failure.phase, failure.step) == ("hang", 2, "backward", 100), failure
    assert "failure.phase_timeout_s=4" in failure.message
    assert controller.summary_["restarts"] == 1 and controller.summary_["failures"][0]["kind"] == "hang"
    assert weights_equal(tmp_path / "final.safetensors", reference)
    assert leftovers(ray_cluster) == ([], [])


def test_giving_up_after_max_restarts_names_the_cause_and_leaves_nothing(tmp_path, ray_cluster, small_dataset):
    controller, error = controller_run(tmp_path, ray_cluster, small_dataset, AlwaysDiesAtStep50,
                                       "failure.max_restarts=2")
    assert isinstance(error, TrainingFailed), error
    text = str(error)
    assert "training stopped after 2 restarts (failure.max_restarts=2 reached)" in text
    assert "rank 3 died at step 50" in text
    assert "step-000040" in text and "run the same command again" in text.lower()
    assert len(controller.failures) == 3 and controller.tracker.status == "FAILED"
    assert [f.decision for f in controller.failures] == ["restart", "restart", "give_up"]
    assert controller.tracker.metrics[50]["restarts"] == 2
    assert leftovers(ray_cluster) == ([], [])


def test_the_controller_killed_and_the_command_rerun_resumes(tmp_path, ray_cluster, small_dataset, reference):
    args = cli_args(tmp_path, small_dataset, f"cluster.address={ray_cluster}")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    proc = subprocess.Popen([str(BIN / "rayzero"), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: committed(tmp_path / "runs" / "checkpoints"), 120, "the first commit")
    proc.kill()  # SIGKILL: no cleanup runs in the driver
    proc.wait()
    # Ray ends a dead driver's actors and placement groups by itself.
    wait_for(lambda: not rank_pids(), 60, "the killed job's ranks to go")
    wait_for(lambda: leftovers(ray_cluster) == ([], []), 60, "the killed job's placement group to go")
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["start_step"] >= 40 and s["resumed_from"].endswith(f"step-{s['start_step']:06d}")
    assert weights_equal(tmp_path / "final.safetensors", reference)


ELASTIC = ["train.global_batch_size=24", "cluster.cpus_per_worker=1", "cluster.min_workers=2",
           "cluster.placement_timeout_s=3", "train.steps=200"]


def test_elastic_shrinks_when_a_node_is_lost_and_grows_back_when_it_returns(tmp_path, small_dataset):
    """A 2-node cluster (3 CPUs + 1 CPU) of 4 ranks loses its 1-CPU node after the first
    commit: the run goes on at 3 ranks (24 sequences = 3 x 4 x 2), resharded from the commit;
    the node comes back and the run grows to 4 ranks at the next checkpoint. The global batch
    never changes, so the losses follow the unbroken 4-rank run's."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    spare = cluster.add_node(num_cpus=1)
    try:
        reference, error = elastic_run(tmp_path / "a", cluster, small_dataset)
        assert error is None, error
        events = []

        def chaos(controller):
            wait_for(lambda: committed(tmp_path / "b" / "runs" / "checkpoints"), 120, "the first commit")
            cluster.remove_node(spare, allow_graceful=False)
            events.append(("removed", time.time()))
            wait_for(lambda: controller.world == 3 and controller.history.steps
                     and controller.history.steps[-1] > 45, 120, "training at 3 ranks")
            cluster.add_node(num_cpus=1)
            events.append(("added", time.time()))

        controller, error = elastic_run(tmp_path / "b", cluster, small_dataset, chaos)
        assert error is None, error
    finally:
        cluster.shutdown()
    assert [e for e, _ in events] == ["removed", "added"]
    assert controller.failures[-1].world_size == 3, controller.failures
    assert "shrink" in [f.decision for f in controller.failures]
    (grew,) = controller.resizes
    assert grew["from"] == 3 and grew["to"] == 4 and grew["step"] % 40 == 0
    assert controller.world == 4
    got = {k: v["loss"] for k, v in controller.tracker.metrics.items()}
    want = {k: v["loss"] for k, v in reference.tracker.metrics.items()}
    assert got.keys() == want.keys() == set(range(200))
    # fp32 sums in another order at 3 ranks: equal to within fp32 rounding, compounded over steps
    assert [got[k] for k in sorted(got)] == pytest.approx([want[k] for k in sorted(want)], rel=1e-4)
    final, ref = load_file(tmp_path / "b" / "final.safetensors"), load_file(tmp_path / "a" / "final.safetensors")
    # The weights as a whole. (Single tensors may differ more: the attention key bias has an
    # exactly-zero gradient up to rounding, which Adam turns into full ±lr steps either way.)
    diff = torch.cat([(final[k] - ref[k]).flatten() for k in ref]).norm()
    assert (diff / torch.cat([ref[k].flatten() for k in ref]).norm()).item() < 1e-4


def elastic_run(tmp: Path, cluster, data: str, chaos=None):
    """The controller trains in a thread; `chaos(controller)` runs here meanwhile (adding a
    node must happen on the main thread)."""
    tmp.mkdir()
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
        controller = Controller(cfg, data, str(tmp), NullTracker(), progress=False, checkpoints=Checkpoints(cfg))
        thread = threading.Thread(target=fit, daemon=True)
        thread.start()
        if chaos:
            chaos(controller)
        thread.join(timeout=300)
        assert not thread.is_alive(), "training did not finish"
    finally:
        ray.shutdown()
    return controller, (errors or [None])[0]
