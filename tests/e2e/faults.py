"""What the failure tests share: the run they strike, the uninterrupted run's result they end
on (`reference`, in conftest.py), fault-injecting rank classes' base, and the controller run in
this process with a tracker that keeps what it logs."""

import os
import sys
import time
from pathlib import Path

import ray
import torch
from ray import cloudpickle
from safetensors.torch import load_file

from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.controller import Controller
from rayzero.config import load_config
from rayzero.workers.actor import RankShim, rank_actor

# 2 ranks on the 2-CPU test cluster, 2 micro-batches each per step; a commit every 8 steps: each
# fault strikes between two commits, and the run has commits left after it to resume from.
STEPS, EVERY = 40, 8
STRIKE = EVERY + 4  # a step between the first commit and the second
RUN = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64",
       "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2",
       "cluster.num_workers=2", f"train.steps={STEPS}", f"checkpoint.every_steps={EVERY}", "failure.backoff_s=0.2"]


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


def shut_down(cluster) -> None:
    """`ray.cluster_utils.Cluster.shutdown`, its nodes' processes killed at once rather than
    stopped gracefully (about a second on 2 cores). Like it, the cluster's address is removed
    from /tmp/ray/ray_current_cluster: a later `ray.init()` with no address would connect to
    the dead cluster (and wait) instead of starting a Ray of its own."""
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node, allow_graceful=False)
    if cluster.head_node is not None:
        cluster.remove_node(cluster.head_node, allow_graceful=False)
    ray.experimental.internal_kv._internal_kv_reset()
    ray._common.utils.reset_ray_address()
    ray._private.services.find_gcs_addresses.cache_clear()


def committed(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("step-*/manifest.json"))


def weights_equal(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


class Reference:
    """The uninterrupted run: its final weights and each step's loss."""

    def __init__(self, weights: Path, losses: dict[int, float]):
        self.weights, self.losses = weights, losses


class OnceMarker:
    """Faults that happen once per test each, whichever group of rank actors reaches them
    first: a marker file per fault says it already has."""

    marker: str = ""

    def _first_time(self, fault: str) -> bool:
        try:
            fd = os.open(f"{self.marker}-{fault}", os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return False
        os.close(fd)
        return True


class NoFault(OnceMarker):
    pass


class NullTracker:
    """Keeps what the controller logs, for the assertions."""

    uri = run_id = ""
    spilled_to = None

    def __init__(self):
        self.metrics, self.tags, self.tag_updates, self.rewinds = {}, {}, [], []

    def log_metrics(self, step, metrics):
        self.metrics.setdefault(step, {}).update(metrics)

    def set_tags(self, tags):
        self.tags.update(tags)
        self.tag_updates.append(dict(tags))

    def rewind(self, step, metrics, tags=()):
        self.rewinds.append(step)

    def finish(self, status="FINISHED"):
        self.status = status


def controller_run(tmp: Path, address: str, data: str, actor: type, *extra: str):
    """The controller in this process with a fault-injecting rank class; returns it after fit
    (or after fit raised: the exception is returned too)."""
    for module in {__name__, actor.__module__}:  # workers cannot import tests/
        cloudpickle.register_pickle_by_value(sys.modules[module])
    from rayzero import release_ranks

    release_ranks()  # ranks an earlier `train_here` kept: their CPUs, and this process's Ray connection
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
