"""The Python SDK and the quickstart notebook, on real Ray."""

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from rayzero import Result, TrainConfig, Trainer
from tests.e2e.conftest import leftovers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
FAST = {"model": {"n_layer": 2, "n_embd": 64, "n_head": 4},
        "train": {"seq_len": 64, "global_batch_size": 8, "micro_batch_size": 2},
        "optim": {"warmup_steps": 2}}


def config(tmp_path, data, address, **sections):
    base = {k: dict(v) for k, v in FAST.items()}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    base["train"]["output_dir"] = str(tmp_path / "runs")
    return TrainConfig(data={"path": data}, cluster={"address": address}, **base)


def test_fit_returns_a_result_and_runs_twice_in_one_process(tmp_path, ray_cluster, small_dataset, capfd):
    """Train 12 steps, then resume to 20 from Python: one run, one history. The second call
    says where it resumes, keeps the learning-rate schedule the run started with (12 steps,
    then min_lr) and warns about it, continues the same MLflow run, and its history holds every
    step from 0. With `cluster.keep_ranks` it runs in the first call's rank processes, which
    `release_ranks()` then ends, leaving nothing on the cluster."""
    from mlflow.tracking import MlflowClient

    from rayzero import release_ranks
    from tests.e2e.faults import rank_pids, wait_for

    cfg = config(tmp_path, small_dataset, ray_cluster, train={"steps": 12}, checkpoint={"every_steps": 5})
    cfg = cfg.override("cluster.keep_ranks=true")
    first = Trainer(cfg, progress=False).fit()
    kept = rank_pids()
    assert len(kept) == 2, "the first run's ranks are kept"
    assert isinstance(first, Result) and first.metrics["steps"] == 12
    h = first.history
    assert list(h.index) == list(range(12))
    assert {"loss", "tokens_per_s", "step_ms", "phase_backward_ms", "lr"} <= set(h.columns)
    assert h["loss"].iloc[-1] == pytest.approx(first.metrics["final_loss"])
    assert first.checkpoint.endswith("step-000012") and first.mlflow_run_id
    fig = first.plot(tmp_path / "run.png")
    assert [a.get_title() for a in fig.axes] == ["loss", "tokens/s", "time per phase (ms, slowest rank)"]
    assert (tmp_path / "run.png").stat().st_size > 10_000

    # Again in the same process, with a longer run: it resumes from the first one's commit.
    capfd.readouterr()
    second = Trainer(cfg, ["train.steps=20"], progress=False).fit()
    err = capfd.readouterr().err
    assert f"rayzero: resuming from {first.checkpoint} at step 12 of 20" in err
    assert f"] resuming from checkpoint {first.checkpoint} (step 12)" in err  # a start-up line, from Python too
    assert "] training 8 steps from step 12" in err and second.summary["startup"]["total_s"] > 0
    assert "] taking the 2 ranks the last run kept (1 CPU each)" in err and rank_pids() == kept
    assert "runs past the learning-rate schedule this run started with (12 steps)" in err
    assert second.metrics["start_step"] == 12 and second.metrics["steps"] == 8
    assert list(second.history.index) == list(range(20))
    assert second.history["loss"].iloc[:12].tolist() == h["loss"].tolist()
    lr = second.history["lr"]
    assert lr.iloc[11:].tolist() == pytest.approx([cfg.optim.final_lr] * 9)  # the schedule ended at step 11
    assert second.mlflow_run_id == first.mlflow_run_id
    client = MlflowClient(second.summary["mlflow_tracking_uri"])
    assert sorted(m.step for m in client.get_metric_history(second.mlflow_run_id, "loss")) == list(range(20))
    run = client.get_run(second.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "12"
    assert run.data.tags["resumed_at_step_12"] == "train.steps: 12 -> 20"
    assert second.summary["run_dir"] == first.summary["run_dir"]
    assert leftovers(ray_cluster)[0] == ["RankShim"] * 2  # kept for a third run
    # Each rank process froze its imports at its start (`collect_and_freeze`), and again once each
    # run had released its model (`leave`): what its full collections scan is what the next
    # run makes, not torch's and Ray's objects, nor what a run imported and cached
    from rayzero.cluster.worker_group import KEPT

    seen = ray.get([a.__ray_call__.remote(lambda _: (__import__("gc").get_freeze_count(),
                                                     len(__import__("gc").get_objects())))
                    for a in KEPT.group.actors])
    assert all(frozen > 100_000 and tracked < 1_000 for frozen, tracked in seen), seen  # 3,554 before `leave` froze
    # A kept rank that died while idle: the third run starts new ones, and keeps those.
    os.kill(kept[0], signal.SIGKILL)
    capfd.readouterr()
    third = Trainer(cfg, ["train.steps=22"], progress=False).fit()
    assert third.metrics["steps"] == 2 and "] placing 2 ranks (1 CPU each) and starting their processes" in \
        capfd.readouterr().err
    assert len(rank_pids()) == 2 and set(rank_pids()).isdisjoint(kept)
    release_ranks()
    wait_for(lambda: leftovers(ray_cluster) == ([], []) and not rank_pids(), 10, "the kept ranks to end")


def test_an_interrupt_stops_cleanly_and_keeps_the_last_commit(tmp_path, ray_cluster, small_dataset):
    from mlflow.tracking import MlflowClient

    from rayzero.checkpoint.manifest import open_checkpoint
    from rayzero.checkpoint.tools import verify_checkpoint

    # Bounded, so that a lost interrupt fails the test instead of hanging it.
    cfg = config(tmp_path, small_dataset, ray_cluster, train={"steps": 1500}, checkpoint={"every_steps": 20})
    root = tmp_path / "runs" / "checkpoints"

    def interrupt_after_a_commit():
        deadline = time.monotonic() + 120
        while not list(root.glob("step-*/manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C and Jupyter's stop button send

    handler = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_after_a_commit, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, progress=False).fit()
    assert signal.getsignal(signal.SIGINT) is handler, "the caller's handler is back"
    assert leftovers(ray_cluster) == ([], [])
    committed = sorted(root.glob("step-*/manifest.json"))
    assert committed
    last = open_checkpoint(str(committed[-1].parent), cfg.checkpoint)
    assert verify_checkpoint(last) > 0
    client = MlflowClient(f"sqlite:///{next((tmp_path / 'runs').glob('*/mlflow.db'))}")
    runs = client.search_runs([client.get_experiment_by_name("rayzero").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


def test_the_quickstart_notebook_runs_headless(tmp_path, ray_cluster, monkeypatch):
    """The notebook's `fit()` joins the session's cluster (RAY_ADDRESS in the kernel's
    environment), as in a notebook on a cluster's head node; starting a local Ray of its own is
    the code path of `rayzero train` with no address, which test_cli.py runs."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)  # the kernel inherits it
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "loss on a line of Python" in text and "sample: " in text
    # The start-up's lines appear under the cell as each stage begins (stderr, as in a terminal).
    said = re.findall(r"^rayzero: \[ *[\d.]+s\] (.*)$", text, re.M)
    assert said[0] == "checking the config, the data and the model" and said[-1].startswith("training "), said
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is drawn"
    assert (tmp_path / "runs" / "quickstart" / "checkpoints" / "step-000060" / "manifest.json").exists()
