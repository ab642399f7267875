"""The CLI as a user types it, on real Ray clusters, with MLflow read back afterwards. The
sharded strategies' runs call the CLI's `main` in this process (what they test is the strategy
through Ray and its report, not the entry point, which the other tests here run as processes)."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from rayzero.config import load_config
from rayzero.models.gpt import build_model
from tests.e2e.conftest import leftovers, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
FAST = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64",
        "train.global_batch_size=8", "train.micro_batch_size=2"]


def startup_said(err: str) -> list[str]:
    """The start-up's status lines in the order said, each without its time and its
    parenthesis; the times must not go backwards."""
    import re

    said = [m.groups() for m in re.finditer(r"^rayzero: \[ *(\d+\.\d)s\] (\S.*)$", err, re.MULTILINE)]  # not the
    # indented lines under a stage (what the checks found: the defaults, the length)
    times = [float(t) for t, _ in said]
    assert times == sorted(times) and times[0] < 1.0, said
    return [text.split(" (")[0] for _, text in said]


def startup_stages(ray_line: str, world: int, steps: int, kept: bool = False) -> list[str]:
    """The start-up's lines of a run; `kept`: its ranks are those an earlier run kept."""
    placing = f"taking the {world} ranks the last run kept" if kept else f"placing {world} ranks"
    return ["checking the config, the data and the model", ray_line, placing,
            "building and sharding the model on the ranks", "compiling the iteration", f"training {steps} steps"]


def local_ray_sessions() -> set[Path]:
    """The session folders of the Ray instances started on this machine with the default
    temporary folder (the session's cluster keeps its own)."""
    from ray._common.utils import get_default_ray_temp_dir

    return set(Path(get_default_ray_temp_dir()).glob("session_2*"))


def gcs_servers() -> set[int]:
    """PIDs of the GCS servers on this machine: one per running Ray instance."""
    pids = set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes().split(b"\0")[0].endswith(b"/gcs_server"):
                pids.add(int(d.name))
        except OSError:
            pass
    return pids


def test_train_on_a_local_ray_with_defaults(tmp_path, small_dataset):
    """No cluster address: the CLI starts a local Ray of its own (the only CLI run here that
    does: the README's first command depends on it), without its dashboard, trains, logs to a
    sqlite MLflow store, and stops that Ray when it is done."""
    steps = 12
    summary_path = tmp_path / "summary.json"
    weights = tmp_path / "final.safetensors"
    sessions, running = local_ray_sessions(), gcs_servers()
    r = run_cli("train", f"train.steps={steps}", f"data.path={small_dataset}", f"train.save_final={weights}",
                "optim.warmup_steps=2", *FAST, "--summary-json", str(summary_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert startup_said(r.stderr) == startup_stages("starting a local Ray", 2, steps)
    # Ray's start began with the checks, before torch was imported (RayStart), not after them
    began = float(r.stderr.split("starting a local Ray (begun at ", 1)[1].split("s, beside the checks)")[0])
    assert began < 1.0, r.stderr
    # and the ranks' placement as soon as Ray was up, in the same thread (place_ahead), taken by the run
    placed = r.stderr.split("placing 2 ranks (1 CPU each) and starting their processes (begun at ", 1)[1]
    assert began < float(placed.split("s, as Ray came up)")[0]), r.stderr
    assert "building and sharding the model on the ranks (initial values, seed 0)" in r.stderr
    (session,) = local_ray_sessions() - sessions  # the CLI started a Ray of its own
    # with no dashboard (cluster.dashboard=false): Ray's head process keeps only its minimal part
    assert "http server disabled" in (session / "logs" / "dashboard.log").read_text()
    deadline = time.monotonic() + 10
    while gcs_servers() - running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not gcs_servers() - running, "and stopped it"
    assert "trained 12 steps" in r.stdout
    # Only rayzero's own lines: no Ray token-auth note, no MLflow table creation.
    assert "Token authentication is enabled" not in r.stderr and "MLflow database tables" not in r.stderr + r.stdout
    s = json.loads(summary_path.read_text())
    assert s["tokens_per_s_per_rank"] == pytest.approx(s["tokens_per_s"] / 2) and s["mfu"] is None  # a CPU: no peak
    act = s["memory"]["activations_peak_bytes"]
    assert act > 0 and f"activations {act / 2**20:.1f} MiB a micro-batch at their peak" in r.stdout
    assert f"({s['tokens_per_s_per_rank']:,.0f} per rank)" in r.stdout
    assert s["steps"] == steps and s["world_size"] == 2 and s["strategy"] == "optim"
    assert s["final_loss"] < s["first_loss"] - 0.3, "the model must learn"
    assert s["tokens_per_s"] > 0 and set(s["phase_ms"]) == {"gather", "forward", "backward", "reduce_grads", "step", "evaluate"}
    assert s["run_dir"].startswith(str(tmp_path / "runs"))
    assert s["mlflow_tracking_uri"] == f"sqlite:///{s['run_dir']}/mlflow.db"

    client = MlflowClient(s["mlflow_tracking_uri"])
    run = client.get_run(s["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == str(steps)
    assert run.data.params["sharding.strategy"] == "optim"
    assert run.data.tags["strategy"] == "optim" and run.data.tags["world_size"] == "2"
    history = client.get_metric_history(s["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == list(range(steps))
    assert max(history, key=lambda m: m.step).value == pytest.approx(s["final_loss"])
    for key in ("lr", "grad_norm", "tokens_per_s", "step_ms", "phase_backward_ms"):
        assert len(client.get_metric_history(s["mlflow_run_id"], key)) == steps, key
    (first_act, *_) = client.get_metric_history(s["mlflow_run_id"], "memory_activations_peak_mib")
    assert first_act.value == pytest.approx(act / 2**20)

    # The exported weights load into the model by its own state_dict names.
    cfg = load_config(None, [*FAST])
    model = build_model(cfg.model, cfg.block_size, seed=0)
    state = load_file(weights)
    assert state.keys() == model.state_dict().keys()
    model.load_state_dict(state)
    assert not torch.equal(state["wte.weight"], build_model(cfg.model, cfg.block_size, 0).wte.weight)


def session_processes(session: Path) -> list[str]:
    """The live processes of one local Ray session (each names its session folder in its
    command line: the GCS, the raylet, the dashboard's head, the agents, the workers)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(session).encode() in (d / "cmdline").read_bytes():
                found.append((d / "cmdline").read_bytes().split(b"\0")[0].decode())
        except OSError:
            pass
    return found


def gone(session: Path, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not session_processes(session)


def test_a_mistake_or_a_ctrl_c_while_ray_starts_is_said_and_leaves_nothing_behind(tmp_path, small_dataset):
    """Ray's start begins beside the checks; a mistake they find then (here a model directory
    that holds no model, found once the model code is imported) is said in one line, as
    before, and every process of the Ray begun for the run is gone with the command; so after a
    Ctrl-C while it starts. A mistyped data path is refused before Ray's start begins."""
    import signal
    import subprocess

    from tests.e2e.conftest import BIN

    sessions = local_ray_sessions()
    r = run_cli("train", f"data.path={small_dataset}", "model.kind=hf", f"model.path={tmp_path / 'none'}",
                "--no-progress", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("rayzero: error: model.path"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()
    (session,) = local_ray_sessions() - sessions  # Ray's start had begun
    assert gone(session), session_processes(session)
    # Ctrl-C once the checks are done, while the run waits for its Ray
    sessions = local_ray_sessions()
    # (SIGINT's default restored in the child, as a terminal has it: a suite started in the
    # background by a shell has SIGINT ignored, and its children inherit that)
    p = subprocess.Popen([str(BIN / "rayzero"), "train", f"data.path={small_dataset}", "--no-progress"], cwd=tmp_path,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_AUTH_MODE": "token"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert "checking the config" in p.stderr.readline()
    assert "pretraining defaults (random init)" in p.stderr.readline()  # under the checks, what they found
    assert "starting a local Ray" in p.stderr.readline()
    p.send_signal(signal.SIGINT)
    err = p.stderr.read()
    assert p.wait(timeout=60) == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("rayzero: "), err
    for session in local_ray_sessions() - sessions:
        assert gone(session), session_processes(session)
    # A data path that does not exist is refused before Ray's start begins, as it was before.
    sessions = local_ray_sessions()
    r = run_cli("train", f"data.path={tmp_path / 'nothing'}", "--no-progress", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(f"rayzero: error: no dataset at {tmp_path}")
    assert local_ray_sessions() == sessions, "no Ray was started"


@pytest.fixture(scope="module")
def rayzero_sources(tmp_path_factory):
    """rayzero's own sources, prepared by `rayzero data prepare` as a user would."""
    tmp = tmp_path_factory.mktemp("prepared")
    data = tmp / "data"
    prep = run_cli("data", "prepare", str(load_config.__code__.co_filename).rsplit("/", 1)[0], str(data),
                   "--glob", "*.py", cwd=tmp)
    assert prep.returncode == 0, prep.stderr
    assert "tokens" in prep.stdout and (data / "meta.json").is_file()
    return data


@pytest.mark.parametrize("strategy, dispatch", [("no_shard", "chained"), ("optim", "compiled")])
def test_train_on_a_running_cluster_leaves_nothing_behind(tmp_path, ray_cluster, rayzero_sources, strategy, dispatch):
    r = run_cli("train", f"cluster.address={ray_cluster}", f"sharding.strategy={strategy}", f"cluster.dispatch={dispatch}",
                f"data.path={rayzero_sources}", "train.steps=4", "tracking.enabled=false", *FAST,
                "--no-progress", "--summary-json", str(tmp_path / "s.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # Joined and placed beside the checks (RayStart, place_ahead): both said begun before the checks ended
    said = {line.split("] ", 1)[1].split(" (")[0]: line for line in r.stderr.splitlines()
            if line.startswith("rayzero: [") and not line.split("] ", 1)[1].startswith(" ")}
    checks_end = float(said[f"joining the Ray cluster at {ray_cluster}"].split("[")[1].split("s]")[0])
    placing = said["placing 2 ranks"]
    assert "(begun at " in placing and float(placing.split("(begun at ")[1].split("s, ")[0]) < checks_end, r.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["strategy"] == strategy and summary["dispatch"] == dispatch
    assert summary["final_loss"] < summary["first_loss"]
    actors, groups = leftovers(ray_cluster)
    assert actors == [] and groups == []


def test_too_many_workers_fails_after_the_placement_wait(tmp_path, ray_cluster, small_dataset):
    r = run_cli("train", f"cluster.address={ray_cluster}", "cluster.num_workers=4",
                "cluster.placement_timeout_s=3", f"data.path={small_dataset}", "tracking.enabled=false",
                "train.global_batch_size=16", cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    assert "cluster.num_workers=4" in r.stderr and "cluster.placement_timeout_s" in r.stderr
    assert "Traceback" not in r.stderr
    actors, groups = leftovers(ray_cluster)
    assert actors == [] and groups == []


SHARDED = [
    # tensor parallel 2 x ZeRO-3 over 2 data-parallel ranks: 18/d per parameter a rank holds
    pytest.param(4, ["sharding.strategy=optim_grads_params", "sharding.param_dtype=bf16", "parallel.tp=2",
                     "cluster.cpus_per_worker=0.5"], 18 / 2, id="tp2-zero3-bf16"),
    pytest.param(2, ["sharding.strategy=optim", "sharding.param_dtype=fp16", "sharding.initial_loss_scale=1e6",
                  "optim.warmup_steps=0"],
                 6 + 12 / 2, id="zero1-fp16-overflowing"),
]


@pytest.mark.parametrize("world, extra, formula", SHARDED)
def test_sharded_strategies_train_through_ray_and_report_their_memory(tmp_path, ray_cluster, small_dataset,
                                                                       train_here, world, extra, formula):
    weights = tmp_path / "final.safetensors"
    code, out, err, s = train_here(f"cluster.num_workers={world}", f"data.path={small_dataset}", "train.steps=6",
                                   f"train.save_final={weights}", *FAST, *extra)
    assert code == 0, err[-3000:]
    # One line per start-up stage as it begins (--no-progress keeps them), then each stage's time.
    ray_line = startup_said(err)[1]
    assert ray_line in (f"joining the Ray cluster at {ray_cluster}", "using the Ray this process is connected to")
    kept = startup_said(err)[2].startswith("taking")  # a run before, in this process, placed alike (KEEP)
    assert startup_said(err) == startup_stages(ray_line, world, 6, kept)
    assert set(s["startup"]) == {"checks_s", "ray_s", "placement_s", "build_s", "compile_s", "first_step_s", "total_s"}
    assert sum(v for k, v in s["startup"].items() if k != "total_s") == pytest.approx(s["startup"]["total_s"], abs=0.01)
    assert f"first step done {s['startup']['total_s']:.1f} s after the start (checks " in out
    assert s["final_loss"] < s["first_loss"] and s["world_size"] == world
    mem = s["memory"]
    assert set(mem["bytes_per_param"]) == {"compute_params", "main_params", "optimizer", "grads", "frozen_params",
                                           "total"}
    # padding adds at most a few percent on this small model
    assert formula <= mem["bytes_per_param"]["total"] <= formula * 1.05
    if any(e.startswith("sharding.strategy=optim_grads") for e in extra):  # full gradient buckets
        assert mem["transient_bytes"] > 0
    assert "memory per rank, bytes/parameter" in out
    client = MlflowClient(s["mlflow_tracking_uri"])
    tp = 2 if "parallel.tp=2" in extra else 1
    assert s["tp"] == tp and client.get_run(s["mlflow_run_id"]).data.params["parallel.tp"] == str(tp)
    assert ("tensor parallel 2" in out) == (tp == 2)
    if "sharding.param_dtype=fp16" in extra:  # the overflowing first steps are skipped, and say so
        assert s["skipped_steps"] > 0 and "skipped by loss scaling" in out
        skipped = client.get_metric_history(s["mlflow_run_id"], "skipped_step")
        assert sum(m.value for m in skipped) == s["skipped_steps"]
        assert len(client.get_metric_history(s["mlflow_run_id"], "loss_scale")) == s["steps"]
    assert client.get_metric_history(s["mlflow_run_id"], "memory_total_bytes_per_param")[-1].value == \
        pytest.approx(mem["bytes_per_param"]["total"])
    # The exported weights are the fp32 main parameters, whole, under the model's own names.
    cfg = load_config(None, [*FAST])
    model = build_model(cfg.model, cfg.block_size, seed=0)
    state = load_file(weights)
    model.load_state_dict(state)
    assert all(v.dtype == torch.float32 for v in state.values())
    if "sharding.param_dtype=bf16" in extra:
        w = state["blocks.0.mlp.fc.weight"]
        assert not torch.equal(w, w.bfloat16().float()), "exported from fp32 main params, not bf16 copies"


@pytest.mark.parametrize("signum, code, said", [(2, 130, "stopped"), (15, 143, "terminated (SIGTERM): stopped")],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_after_the_iteration_with_one_line_and_exit_130(tmp_path, ray_cluster, small_dataset, signum,
                                                                     code, said):
    """Ctrl-C in a terminal (SIGINT to the whole foreground process group), or SIGTERM as `ray
    job stop` and Kubernetes send it: the run stops after the iteration in flight, says in one
    line where it stopped and what a rerun resumes from, exits 128 + the signal (130, 143), no
    traceback and no stack dump of Ray's; nothing is left on the cluster."""
    import os
    import subprocess

    from tests.e2e.conftest import BIN

    args = ["train", "--no-progress", f"data.path={small_dataset}", *FAST, "train.steps=2000",
            "checkpoint.every_steps=5", "tracking.enabled=false", f"train.output_dir={tmp_path / 'runs'}"]
    proc = subprocess.Popen([str(BIN / "rayzero"), *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": ray_cluster})
    root = tmp_path / "runs" / "checkpoints"
    deadline = time.monotonic() + 120
    while not list(root.glob("step-*/manifest.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "Stack (most recent call first)" not in err and out == ""
    last = err.strip().splitlines()[-1]
    step = int(last.split("stopped at step ")[1].split(";")[0])
    newest = sorted(root.glob("step-*/manifest.json"))[-1].parent
    assert last == f"rayzero: {said} at step {step}; last checkpoint {newest}; run the same command again to resume"
    assert int(newest.name[5:]) <= step + 1 < 2000
    assert leftovers(ray_cluster) == ([], [])


def test_ctrl_c_then_the_command_again_keeps_one_mlflow_point_per_step(tmp_path, small_dataset, train_here,
                                                                      monkeypatch):
    """Ctrl-C as step 4 is logged stops the run at step 5; the same command again resumes from
    the last commit (step 4's at the latest) in the same MLflow run, and the steps it trains
    again replace their first points: one point per step, the latest value the last step's. A
    Ctrl-C during that run's last act (MLflow's final flush, after every step and the final
    commit) lets it finish: the summary printed and written, the MLflow run FINISHED, and one
    line saying so."""
    import os
    import signal

    from rayzero.jobs.tracking import Tracker

    args = [f"data.path={small_dataset}", *FAST, "cluster.num_workers=1", "train.steps=8",
            "checkpoint.every_steps=2", f"train.output_dir={tmp_path / 'runs'}"]
    log_metrics, finish = Tracker.log_metrics, Tracker.finish

    def ctrl_c_as_step_4_is_logged(self, step, metrics):
        log_metrics(self, step, metrics)
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

    monkeypatch.setattr(Tracker, "log_metrics", ctrl_c_as_step_4_is_logged)
    code, _, err, _ = train_here(*args)
    assert code == 130 and "rayzero: stopped at step 5; last checkpoint " in err, err[-3000:]
    monkeypatch.setattr(Tracker, "log_metrics", log_metrics)

    def ctrl_c_in_the_final_flush(self, status="FINISHED"):
        os.kill(os.getpid(), signal.SIGINT)
        finish(self, status)

    monkeypatch.setattr(Tracker, "finish", ctrl_c_in_the_final_flush)
    code, out, err, s = train_here(*args)
    assert code == 0, err[-3000:]
    assert "rayzero: stopped" not in err
    assert "interrupted after the last step: the run finished and saved everything" in err
    assert f"trained {8 - s['start_step']} steps (resumed at step {s['start_step']})" in out
    assert s["start_step"] <= 4, "steps logged before the stop are trained again"
    assert s["checkpoint"].endswith("step-000008")
    client = MlflowClient(s["mlflow_tracking_uri"])
    loss = client.get_metric_history(s["mlflow_run_id"], "loss")
    assert sorted(m.step for m in loss) == list(range(8))
    run = client.get_run(s["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["loss"] == pytest.approx(s["final_loss"])


def test_a_token_cluster_joined_without_token_mode_says_so_within_seconds(tmp_path, ray_cluster):
    """The session's head uses token authentication; a command run without RAY_AUTH_MODE=token
    is refused in one line saying what to set (Ray's own refusal would repeat every second for
    20 s before a bare "cannot connect"), and leaves no run directory behind."""
    import os
    import subprocess

    from tests.e2e.conftest import BIN

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    r = subprocess.run([str(BIN / "rayzero"), "train", "--no-progress", f"cluster.address={ray_cluster}",
                        "model.n_layer=1", "checkpoint.dir=", "tracking.enabled=false",
                        f"train.output_dir={tmp_path / 'runs'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"rayzero: error: cluster.address: cannot connect to a Ray cluster at '{ray_cluster}': the cluster uses "
        "token authentication: export RAY_AUTH_MODE=token before the command, with the token `ray get-auth-token` "
        "prints on its head node, as RAY_AUTH_TOKEN or in ~/.ray/auth_token")
    assert "InvalidAuthToken" not in r.stderr + r.stdout, "refused before ray.init, not by Ray's retries"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
