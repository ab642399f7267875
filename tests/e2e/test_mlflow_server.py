"""A real `mlflow server` on loopback: what a run logs arrives, and a server that is down or
frozen for a while neither crashes nor stalls training; its metrics arrive when it answers. The
runs are `rayzero train` by the CLI's `main` in this process, on the session's Ray cluster."""

import json
import os
import signal
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port
from tests.e2e.conftest import MlflowServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RUN = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64",
       "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2"]


@pytest.fixture
def server(tmp_path):
    """A server of this test's own: it is stopped and frozen."""
    (tmp_path / "mlflow").mkdir()
    s = MlflowServer(tmp_path / "mlflow")
    yield s
    s.stop()


@pytest.fixture
def train(train_here, tmp_path, small_dataset):
    """A run that must succeed (`train_here`): (stdout, stderr with the log records, summary)."""
    def run(*args):
        code, out, err, s = train_here(f"data.path={small_dataset}", f"train.output_dir={tmp_path / 'runs'}", *RUN,
                                       *args)
        assert code == 0, err[-3000:]
        return out, err, s
    return run


def test_params_metrics_tags_and_config_arrive_and_link_the_checkpoint(tmp_path, mlflow_server, train):
    server = mlflow_server
    out, err, s = train(f"tracking.uri={server.uri}", "tracking.experiment=e2e", "train.steps=12",
                        "checkpoint.every_steps=6")
    client = MlflowClient(server.uri)
    run = client.get_run(s["mlflow_run_id"])
    assert s["mlflow_tracking_uri"] == server.uri and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "e2e"
    assert run.data.params["train.steps"] == "12" and run.data.params["sharding.strategy"] == "optim"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(12))
    assert losses[-1].value == pytest.approx(s["final_loss"])
    assert {"tokens_per_s", "phase_backward_ms", "memory_total_bytes_per_param"} <= set(run.data.metrics)
    tags = run.data.tags
    assert tags["checkpoint"] == s["checkpoint"] and tags["checkpoint"].endswith("step-000012")
    assert tags["checkpoint_dir"] == str(tmp_path / "runs" / "checkpoints")
    assert tags["strategy"] == "optim" and tags["world_size"] == "2"
    local = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    assert json.loads(open(local).read())["train"]["steps"] == 12
    assert "does not answer" not in err


def test_a_rewind_on_a_tracking_server_keeps_the_points_and_says_so_in_a_tag(mlflow_server, caplog):
    """A tracking server has no API to delete points: those of the steps trained again stay, a
    `rewound_at_step_N` tag says which, the run warns once, and an early stop among them goes."""
    from rayzero.jobs.tracking import Tracker

    t = Tracker(mlflow_server.uri, "e2e-rewind", "", {}, {})
    for step in range(4):
        t.log_metrics(step, {"loss": float(step)})
    t.set_tags({"stopped_early": "after step 3"})
    t.rewind(2, ["loss"], tags=["stopped_early"])
    t.log_metrics(2, {"loss": 20.0})
    t.rewind(2, ["loss"])  # a second restart from the same commit
    t.finish()
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(t.run_id)
    assert sorted(m.step for m in client.get_metric_history(t.run_id, "loss")) == [0, 1, 2, 2, 3]
    tag = run.data.tags["rewound_at_step_2"]
    assert tag.startswith("points for steps >= 2 logged before ") and "were trained again" in tag
    assert "stopped_early" not in run.data.tags and run.info.status == "FINISHED"
    assert caplog.text.count("cannot delete metric points") == 1


def test_a_tracking_server_down_at_the_start_and_frozen_later_loses_nothing(tmp_path, server, train, monkeypatch):
    """The server is not up when training starts (the run warns once and goes on), comes up
    some seconds in, is frozen (SIGSTOP: it accepts connections and never answers) for longer
    than a request waits (MLFLOW_HTTP_REQUEST_TIMEOUT, which a user sets as here; 10 s unset),
    and thaws; every step's metrics arrive all the same, and the run finishes normally."""
    root = tmp_path / "runs" / "checkpoints"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")

    def chaos():
        time.sleep(2)
        server.start()
        deadline = time.monotonic() + 120
        while not list(root.glob("step-*/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(server.proc.pid, signal.SIGSTOP)
        time.sleep(5)  # two requests' timeouts and the retry between them
        os.killpg(server.proc.pid, signal.SIGCONT)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    out, err, s = train(f"tracking.uri={server.uri}", "train.steps=300", "checkpoint.every_steps=60",
                        "tracking.flush_timeout_s=120")
    thread.join()
    assert "MLflow at " + server.uri + " does not answer" in err
    assert "Check tracking.uri" in err, "the warning says what to check"
    assert s["steps"] == 300 and s["mlflow_unsent"] is None
    client = MlflowClient(server.uri)
    run_id = s["mlflow_run_id"]
    assert run_id, "the run was created once the server came up"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(300))
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_server_that_never_answers_leaves_the_run_in_the_run_directory_and_the_resume_sends_it(train, tmp_path):
    """Down from the start to the end of a run: its params, tags and metrics stay in the run
    directory. The server back on its address, the same command told 8 steps resumes from the
    step-6 commit and sends them first: one MLflow run, one point per step, the file gone."""
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    out, err, s = train(f"tracking.uri={dead}", "train.steps=6", "tracking.flush_timeout_s=1")
    assert f"MLflow at {dead} does not answer" in err
    assert s["steps"] == 6 and s["mlflow_run_id"] is None
    unsent = json.loads(open(s["mlflow_unsent"]).read())
    assert sorted({m["step"] for m in unsent["metrics"] if m["key"] == "loss"}) == list(range(6))
    assert f"did not answer; unsent metrics in {s['mlflow_unsent']}" in out
    (tmp_path / "mlflow").mkdir()
    server = MlflowServer(tmp_path / "mlflow", port=port).start()
    try:
        out, err, again = train(f"tracking.uri={dead}", "train.steps=8", "tracking.flush_timeout_s=10")
        assert again["start_step"] == 6 and again["run_dir"] == s["run_dir"]
        client = MlflowClient(server.uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.run_id == again["mlflow_run_id"] and run.info.status == "FINISHED"
        assert run.data.params["train.steps"] == "6" and "resumed_at_step_6" in run.data.tags
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(8))
        assert not os.path.exists(s["mlflow_unsent"]), "all of it sent: the file goes"
    finally:
        server.stop()
