"""The MLflow tracker's queue, without a server: a local sqlite store, and an address where
nothing listens."""

import json

from mlflow.tracking import MlflowClient

from rayzero.cluster.tracking import Tracker
from tests.conftest import free_port


def test_everything_arrives_in_order_and_in_batches(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "config.json").write_text('{"train": {"steps": 3}}')
    t = Tracker(uri, "unit", "run-a", {"train.steps": 3}, {"strategy": "optim"},
                artifact_dir=str(tmp_path / "artifacts"), artifacts=[str(tmp_path / "config.json")],
                spill_path=str(tmp_path / "unsent.json"))
    for step in range(1500):  # 3,000 values: more than one MLflow batch
        t.log_metrics(step, {"loss": 1.0 / (step + 1), "lr": 0.1})
    t.set_tags({"checkpoint": "s3://b/step-000003"})
    t.finish("FINISHED")
    client = MlflowClient(uri)
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.params == {"train.steps": "3"}
    assert run.data.tags["strategy"] == "optim" and run.data.tags["checkpoint"] == "s3://b/step-000003"
    history = client.get_metric_history(t.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1500)), "each value once"
    assert [a.path for a in client.list_artifacts(t.run_id)] == ["config.json"]
    assert t.spilled_to is None and not (tmp_path / "unsent.json").exists()


def test_a_server_that_never_answers_costs_no_more_than_the_flush_timeout(tmp_path, caplog):
    uri = f"http://127.0.0.1:{free_port()}"
    t = Tracker(uri, "unit", "", {}, {}, spill_path=str(tmp_path / "unsent.json"), flush_timeout_s=0.5)
    for step in range(5):
        t.log_metrics(step, {"loss": float(step)})
    t.finish("FINISHED")
    assert t.run_id is None and t.spilled_to == str(tmp_path / "unsent.json")
    kept = json.loads((tmp_path / "unsent.json").read_text())
    assert kept["tracking_uri"] == uri and [m["step"] for m in kept["metrics"]] == [0, 1, 2, 3, 4]
    assert f"MLflow at {uri} does not answer" in caplog.text and "Check tracking.uri" in caplog.text
