"""A rank that fails mid-training: the error reaches the caller, nothing stays on the cluster."""

import sys

import pytest
import ray
from ray import cloudpickle

from rayzero.cluster.controller import Controller
from rayzero.config import load_config
from rayzero.workers.actor import RankShim, rank_actor
from tests.e2e.conftest import leftovers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class FailsAtStep2(RankShim):
    def step(self, prev):
        if self.rank.plan["step"] == 2:
            raise RuntimeError("injected failure at step 2")
        return super().step(prev)


class RecordingTracker:
    uri = run_id = ""
    spilled_to = None

    def __init__(self):
        self.steps, self.status = [], None

    def log_metrics(self, step, metrics):
        self.steps.append(step)

    def set_tags(self, tags):
        pass

    def finish(self, status="FINISHED"):
        self.status = status


@pytest.mark.parametrize("dispatch", ["compiled", "chained"])
def test_failing_rank_is_reported_and_cleaned_up(tmp_path, ray_cluster, small_dataset, dispatch):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.seq_len=32",
                             "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=10",
                             f"cluster.dispatch={dispatch}"])
    tracker = RecordingTracker()
    ray.init(address=ray_cluster, logging_level="ERROR")
    try:
        controller = Controller(cfg, small_dataset, str(tmp_path), tracker, progress=False,
                                actor_cls=rank_actor(FailsAtStep2))
        with pytest.raises(Exception, match="injected failure at step 2"):
            controller.fit()
    finally:
        ray.shutdown()
    assert controller.state == "TRAIN"
    assert tracker.steps == [0, 1] and tracker.status == "FAILED"
    actors, groups = leftovers(ray_cluster)
    assert actors == [] and groups == []
