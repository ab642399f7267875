"""Warm spares on a real Ray cluster (gloo), at 2 ranks with one spare beside them: a rank killed
and replaced with no restart, a failure while the spare is put in, a lost node with more ranks
than spares. Each ends on the uninterrupted run's weights bit for bit (`reference`)."""

import os
import threading

import pytest
import ray

from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.controller import Controller
from rayzero.config import load_config
from tests.e2e.conftest import leftovers
from tests.e2e.faults import (EVERY, RUN, STEPS, STRIKE, NullTracker, OnceMarker, committed, controller_run, wait_for,
                              shut_down, weights_equal)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Warm spares: room for one next to the 2 ranks on the 2-CPU test cluster.
SPARE = ["failure.spares=1", "cluster.cpus_per_worker=0.5"]


class DiesOnceBetweenCommits(OnceMarker):
    """Rank 1 dies once, at step STRIKE (after the first commit, at step EVERY)."""

    def step(self, prev):
        if self.rank.plan["step"] == STRIKE and self.rank.mesh.rank == 1 and self._first_time("die"):
            os._exit(1)
        return super().step(prev)


def test_a_warm_spare_takes_a_killed_ranks_place_with_no_restart_and_the_same_result(
        tmp_path, ray_cluster, small_dataset, reference):
    controller, error = controller_run(tmp_path, ray_cluster, small_dataset, DiesOnceBetweenCommits, *SPARE)
    assert error is None, error
    (f,) = controller.failures
    assert (f.kind, f.rank, f.lost, f.decision, f.world_size) == ("rank_died", 1, [1], "replace", 2)
    s = controller.summary_
    assert [(r["rank"], r["step"]) for r in s["replacements"]] == [(1, STRIKE)]
    assert s["world_size"] == 2 and not s["resizes"] and controller.record.states.count("PLACE") == 1, \
        "one placement: the other rank kept its process"
    resumed = [t["resumed_from"] for t in controller.tracker.tag_updates if "resumed_from" in t]
    assert [r.rpartition("/")[2] for r in resumed] == [f"step-{EVERY:06d}"]
    assert "-> replace at 2 ranks" in controller.tracker.tags["failure.1"]
    assert controller.tracker.metrics[STRIKE]["restarts"] == 1 and "recovery_s" in controller.tracker.metrics[EVERY]
    assert weights_equal(tmp_path / "final.safetensors", reference.weights)
    assert leftovers(ray_cluster) == ([], []), "the spares and their placement groups go with the run"


class SpareDiesAsItIsPutIn(DiesOnceBetweenCommits):
    """Rank 1 dies at step STRIKE; the spare dies too, as it is given rank 1's place."""

    def assign(self, rank, world_size):
        if self._first_time("spare-dies"):
            os._exit(1)
        return super().assign(rank, world_size)


class SurvivorDiesRejoining(DiesOnceBetweenCommits):
    """Rank 1 dies at step STRIKE; rank 0, rejoining with the spare, dies in its setup: a second
    failure during the recovery."""

    rejoining = False

    def leave(self, *args):
        self.rejoining = True
        return super().leave(*args)

    def setup(self, *args):
        if self.rejoining and self._first_time("survivor-dies"):
            os._exit(1)
        return super().setup(*args)


@pytest.mark.parametrize("fault", [SpareDiesAsItIsPutIn, SurvivorDiesRejoining])
def test_a_failure_while_a_spare_is_put_in_still_ends_bitwise(tmp_path, ray_cluster, small_dataset, reference, fault):
    controller, error = controller_run(tmp_path, ray_cluster, small_dataset, fault, *SPARE)
    assert error is None, error
    first, second = controller.failures
    assert first.decision == "replace" and first.lost == [1]
    # the spare gone, or rank 0 gone while the group joins again: a fresh group
    assert second.kind == "rank_died" and second.decision == "restart", second
    assert controller.world == 2 and controller.summary_["steps"] == STEPS
    assert weights_equal(tmp_path / "final.safetensors", reference.weights)
    assert leftovers(ray_cluster) == ([], [])


def test_a_lost_node_with_more_ranks_than_spares_restarts_the_group_bitwise(tmp_path, small_dataset, reference):
    """A 2-node cluster: both ranks on one node (2 CPUs), the spare on the other (1 CPU). The
    ranks' node is lost after the first commit: two ranks lost, one spare, so the whole group
    restarts (at the same world, once a node is back) and ends as the unbroken run does."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    cfg = load_config(None, [*RUN, "failure.spares=1", f"data.path={small_dataset}",
                             f"train.output_dir={tmp_path / 'runs'}", f"train.save_final={tmp_path / 'final.safetensors'}"])
    errors = []
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        controller = Controller(cfg, small_dataset, str(tmp_path), NullTracker(), progress=False,
                                checkpoints=Checkpoints(cfg))

        def fit():
            try:
                controller.fit()
            except Exception as e:
                errors.append(e)

        thread = threading.Thread(target=fit, daemon=True)
        thread.start()
        wait_for(lambda: committed(tmp_path / "runs" / "checkpoints") or errors, 120, "the first commit")
        cluster.remove_node(node, allow_graceful=False)
        wait_for(lambda: controller.failures or errors, 60, "the lost node found")
        cluster.add_node(num_cpus=2)
        thread.join(timeout=300)
        assert not thread.is_alive(), "training did not finish"
    finally:
        ray.shutdown()
        shut_down(cluster)
    assert not errors, errors
    # A lost node's ranks are found dead together, or one after the other (the second while the
    # spare is put in): either way both are lost and the group restarts whole, at 2 ranks.
    lost = [r for f in controller.failures for r in f.lost]
    assert sorted(set(lost)) == [0, 1] and all(f.kind == "rank_died" for f in controller.failures), controller.failures
    restart = controller.failures[-1]
    assert restart.decision == "restart" and controller.world == 2, controller.failures
    if sorted(controller.failures[0].lost) == [0, 1]:
        assert "ranks 0, 1 died" in controller.failures[0].message
    assert weights_equal(tmp_path / "final.safetensors", reference.weights)
