"""The MLflow tracker's queue, without a server: a local sqlite store, and an address where
nothing listens."""

import json

import pytest
from mlflow.tracking import MlflowClient

from rayzero.jobs.tracking import Tracker
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
    t.rewind(3, ["loss"])  # steps 3 and 4 trained again: one point per step in the file too
    t.log_metrics(3, {"loss": 30.0})
    t.finish("FINISHED")
    assert t.run_id is None and t.spilled_to == str(tmp_path / "unsent.json")
    kept = json.loads((tmp_path / "unsent.json").read_text())
    assert kept["tracking_uri"] == uri
    assert [(m["step"], m["value"]) for m in kept["metrics"]] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert [r["step"] for r in kept["rewinds"]] == [3]
    assert f"MLflow at {uri} does not answer" in caplog.text and "Check tracking.uri" in caplog.text


def test_a_rewind_leaves_one_point_per_step_and_the_latest_values_right(tmp_path):
    """Steps 0..5 logged (and the baseline at -1, and a restart at 5), then training goes back to
    step 3 and trains 3 and 4 again: the store holds each step once, the later values, and the
    run's latest values are step 4's, not the superseded step 5's; `restarts`, not named, stays,
    and so does the baseline. A later run going on from the same run back to step 0 takes the
    baseline too, and a key left with no point has no latest value."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(uri, "unit", "run-r", {}, {})
    t.log_metrics(-1, {"val_loss": 9.0})
    for step in range(6):
        t.log_metrics(step, {"loss": float(step), "lr": 0.1})
    t.log_metrics(5, {"restarts": 1.0})
    t.set_tags({"stopped_early": "after step 5", "strategy": "optim"})
    t.rewind(3, ["loss", "lr"], tags=["stopped_early"])
    for step in (3, 4):
        t.log_metrics(step, {"loss": 10.0 + step, "lr": 0.2})
    t.finish("KILLED")
    client = MlflowClient(uri)
    points = {k: sorted((m.step, m.value) for m in client.get_metric_history(t.run_id, k))
              for k in ("loss", "lr", "restarts", "val_loss")}
    assert points == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)],
                      "lr": [(0, 0.1), (1, 0.1), (2, 0.1), (3, 0.2), (4, 0.2)],
                      "restarts": [(5, 1.0)], "val_loss": [(-1, 9.0)]}
    run = client.get_run(t.run_id)
    assert run.data.metrics == {"loss": 14.0, "lr": 0.2, "restarts": 1.0, "val_loss": 9.0}
    assert "stopped_early" not in run.data.tags and run.data.tags["strategy"] == "optim"

    again = Tracker(uri, "unit", "run-r", {}, {}, resume=(t.run_id, 0))
    again.rewind(0, ["loss", "lr", "val_loss"], tags=["stopped_early"])
    again.log_metrics(0, {"loss": 20.0})
    again.finish("FINISHED")
    assert again.run_id == t.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "loss")] == [(0, 20.0)]
    assert client.get_metric_history(t.run_id, "val_loss") == [] == client.get_metric_history(t.run_id, "lr")
    assert client.get_run(t.run_id).data.metrics == {"loss": 20.0, "restarts": 1.0}


@pytest.mark.slow  # ~10 s: in the full suite, not the fast tier
def test_calls_made_while_the_thread_imports_mlflow_all_arrive(tmp_path):
    """In a fresh interpreter (MLflow not yet imported), metrics and tags logged at once, while
    the thread is importing MLflow: the caller's thread never imports it (two threads importing
    it at once find its modules half made), and everything arrives."""
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = ("import sys; from rayzero.jobs.tracking import Tracker\n"
            f"t = Tracker({uri!r}, 'unit', 'run-i', {{}}, {{}})\n"
            "for step in range(200):\n"
            "    t.log_metrics(step, {'loss': float(step)}); t.set_tags({'at': step})\n"
            "t.finish(); print(t.run_id)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "does not answer" not in run.stderr, run.stderr[-3000:]
    run_id = run.stdout.split()[-1]
    client = MlflowClient(uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(200))
    assert client.get_run(run_id).data.tags["at"] == "199"


@pytest.mark.slow  # ~10 s: in the full suite, not the fast tier
def test_a_new_sqlite_store_starts_as_mlflow_would_make_it(tmp_path, monkeypatch):
    """A new store is a copy of an empty one made once with MLflow's own migrations: the same
    schema and version as a store MLflow makes itself, the Default experiment added by MLflow as
    it opens it; an existing store is never touched."""
    import sqlite3

    from rayzero.jobs.tracking import seed_sqlite_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    seeded, own = tmp_path / "seeded.db", tmp_path / "own.db"
    seed_sqlite_store(f"sqlite:///{seeded}")
    assert seeded.is_file() and [p.name for p in (tmp_path / "cache" / "rayzero").iterdir()] == [
        f"mlflow-{__import__('mlflow').__version__}-schema.db"]
    MlflowClient(f"sqlite:///{own}").search_experiments()  # MLflow makes this one itself

    experiments = {e.name: e for e in MlflowClient(f"sqlite:///{seeded}").search_experiments()}
    assert list(experiments) == ["Default"] and experiments["Default"].experiment_id == "0"

    def schema(path):  # each table and index, and the migration the store is at
        with sqlite3.connect(path) as db:
            return (set(db.execute("SELECT type, name FROM sqlite_master")),
                    db.execute("SELECT version_num FROM alembic_version").fetchall())

    (ours, version), (theirs, their_version) = schema(seeded), schema(own)
    assert (ours - theirs, theirs - ours, version) == (set(), set(), their_version)
    before = seeded.read_bytes()
    seed_sqlite_store(f"sqlite:///{seeded}")
    assert seeded.read_bytes() == before


def test_what_a_server_never_took_goes_into_one_run_when_the_run_goes_on(tmp_path):
    """MLflow down from the start to the end: the file keeps the run itself (params, tags, its
    metrics, its end), and the next tracker of the same run directory sends all of it first,
    into the run it then goes on with, and deletes the file; steps trained again supersede
    their first points, as they would have."""
    dead = f"http://127.0.0.1:{free_port()}"
    spill = tmp_path / "mlflow-unsent.json"
    from pydantic import SecretStr

    t = Tracker(dead, "unit", "run-u", {"train.steps": 6, "checkpoint.s3_secret_access_key": SecretStr("s3cret")},
                {"strategy": "optim"}, spill_path=str(spill), flush_timeout_s=0.5)
    for step in range(4):
        t.log_metrics(step, {"loss": float(step)})
    t.finish("KILLED")
    assert "s3cret" not in spill.read_text(), "a secret is kept as MLflow shows it, masked"
    kept = json.loads(spill.read_text())
    assert kept["run_id"] is None and [op[0] for op in kept["ops"]] == ["start", "metrics", "metrics", "metrics",
                                                                          "metrics", "end"]
    # the same directory's next run (here the server is a sqlite store): resumed from step 2
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    again = Tracker(uri, "unit", "run-u", {"train.steps": 6}, {"strategy": "optim"}, spill_path=str(spill),
                    unsent=str(spill), resume=(None, 2))
    again.rewind(2, ["loss"])
    for step in range(2, 6):
        again.log_metrics(step, {"loss": 10.0 + step})
    again.finish("FINISHED")
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    assert run.info.run_id == again.run_id and run.info.status == "FINISHED"
    assert run.data.params == {"train.steps": "6", "checkpoint.s3_secret_access_key": "**********"}
    assert run.data.tags["strategy"] == "optim"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")) == [
        (0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert not spill.exists(), "sent: the file goes"


def test_the_command_sends_what_was_left_without_training(tmp_path, capsys, monkeypatch):
    from tests.conftest import cli_in_process

    dead = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    t = Tracker(dead, "unit", "run-c", {"optim.lr": 0.1}, {"strategy": "no_shard"},
                artifacts=[str(run_dir / "config.json")], spill_path=str(run_dir / "mlflow-unsent.json"),
                flush_timeout_s=0.5)
    for step in range(3):
        t.log_metrics(step, {"loss": 1.0 + step})
    t.finish("FINISHED")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "tracking", "send", str(run_dir), "--uri", uri)
    assert code == 0 and out.startswith(f"sent {run_dir / 'mlflow-unsent.json'} to MLflow run "), err
    client = MlflowClient(uri)
    run = client.get_run(out.split()[-1])
    assert run.info.status == "FINISHED" and run.data.params == {"optim.lr": "0.1"}
    assert [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)] == [
        1.0, 2.0, 3.0]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.json"]
    assert not (run_dir / "mlflow-unsent.json").exists()
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "tracking", "send", str(run_dir))
    assert code == 2 and "nothing left unsent" in err


def test_a_held_tracker_touches_mlflow_only_once_begun_and_loses_nothing(tmp_path, monkeypatch):
    """A run's tracker is held while the ranks start (MLflow's import and store would take their
    CPU): what is logged meanwhile is queued, `run_id` is None at once, no store is made; once
    begun (the first step done), all of it arrives in one run, and `run_id` waits for it."""
    import time

    from rayzero.jobs import tracking

    touched = []
    monkeypatch.setattr(tracking, "seed_sqlite_store", lambda uri: touched.append(uri))  # as the client is made
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(uri, "unit", "run-h", {"train.steps": 3}, {}, held=True)
    for step in range(3):
        t.log_metrics(step, {"loss": float(step)})
    assert t.run_id is None
    time.sleep(0.3)  # time enough for an unheld thread to start on it
    assert not touched and not (tmp_path / "mlflow.db").exists()
    t.begin()
    run_id = t.run_id
    assert run_id and touched == [uri]
    t.finish()
    client = MlflowClient(uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [0, 1, 2]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_held_tracker_finished_before_it_began_still_sends_everything(tmp_path):
    """A run that ends before its first step (refused by the cluster, stopped at once) still
    has its MLflow run, ended as it ended."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(uri, "unit", "run-f", {}, {"strategy": "optim"}, held=True)
    t.set_tags({"failure.1": "placement"})
    t.finish("FAILED")
    run = MlflowClient(uri).get_run(t.run_id)
    assert run.info.status == "FAILED" and run.data.tags["failure.1"] == "placement"
