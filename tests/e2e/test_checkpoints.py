"""Checkpoints through the CLI, against a real S3 server (SeaweedFS) and local paths. `rayzero
train` and `rayzero ckpt` run by the CLI's `main` in this process (what is tested is the
checkpoints, not the entry point, which test_cli.py and test_job_submit.py run as processes);
the runs join the session's Ray cluster (`cluster.address`)."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rayzero.config import load_config
from rayzero.models.gpt import build_model
from tests.conftest import cli_in_process, without_startup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
FAST = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64",
        "train.global_batch_size=8", "train.micro_batch_size=2", "tracking.enabled=false",
        "optim.warmup_steps=2"]


@pytest.fixture
def train(train_here, small_dataset):
    """`rayzero train ARGS…` of the small GPT on the small dataset (`train_here`)."""
    return lambda *args, name="s.json": train_here(f"data.path={small_dataset}", *FAST, *args, summary=name)


@pytest.fixture
def ckpt(tmp_path, capsys, monkeypatch):
    """`rayzero ckpt ARGS…` in this process: (exit code, stdout, stderr)."""
    return lambda *args: cli_in_process(capsys, monkeypatch, tmp_path, "ckpt", *args)


def test_s3_checkpoints_resume_list_verify_and_export(tmp_path, s3_server, ckpt, train):
    s3 = s3_server.overrides()
    where = "checkpoint.dir=s3://ckpt/run-a"
    code, out, err, s = train(where, *s3, "train.steps=10", "checkpoint.every_steps=4",
                              "checkpoint.keep_last=2", f"train.save_final={tmp_path / 'final.safetensors'}")
    assert code == 0, err[-3000:]
    assert s["checkpoint"] == "s3://ckpt/run-a/step-000010" and s["checkpoints_committed"] == 3
    assert s3_server.KEY not in out + err and s3_server.SECRET not in out + err

    code, out, err = ckpt("ls", "s3://ckpt/run-a", *s3)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert [line.split()[2] for line in lines] == ["8", "10"], "keep_last=2 pruned step 4"
    assert "world 2" in lines[-1] and "optim" in lines[-1]
    code, out, err = ckpt("verify", "s3://ckpt/run-a", *s3)
    assert code == 0 and "every checksum matches" in out, err

    out = tmp_path / "export.safetensors"
    code, _, err = ckpt("export", "s3://ckpt/run-a/step-000010", str(out), *s3)
    assert code == 0, err
    exported, final = load_file(out), load_file(tmp_path / "final.safetensors")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    cfg = load_config(None, FAST)
    model = build_model(cfg.model, cfg.block_size, seed=0)
    model.load_state_dict(exported)
    x = torch.randint(0, 256, (2, 64))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    model.load_state_dict(final)
    assert loss.item() == F.cross_entropy(model(x).flatten(0, 1), x.flatten()).item()

    # The same command with more steps continues from the last commit, up to the new total.
    code, out, err, s = train(where, *s3, "train.steps=14", "checkpoint.every_steps=4", name="b.json")
    assert code == 0, err[-3000:]
    assert s["start_step"] == 10 and s["steps"] == 4 and s["resumed_from"] == "s3://ckpt/run-a/step-000010"


def test_a_damaged_shard_is_named_and_auto_falls_back(tmp_path, ckpt, train):
    root = tmp_path / "ck"
    code, out, err, s = train(f"checkpoint.dir={root}", "train.steps=6", "checkpoint.every_steps=3")
    assert code == 0, err[-3000:]
    shard = root / "step-000006" / "shard-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = ckpt("verify", str(root / "step-000006"))
    assert code == 2 and "shard-00001-of-00002.safetensors" in err and "checksum" in err
    code, out, err, s = train(f"checkpoint.dir={root}", "train.steps=8", "checkpoint.every_steps=3", name="b.json")
    assert code == 0, err[-3000:]
    assert s["start_step"] == 3, "the damaged step-6 checkpoint is skipped for step 3"
    assert "step-000006 is damaged" in err and "shard-00001-of-00002.safetensors" in err


def test_another_model_and_uncommitted_prefixes(tmp_path, ray_cluster, small_dataset, capsys, monkeypatch, train):
    root = tmp_path / "ck"
    code, out, err, _ = train(f"checkpoint.dir={root}", "train.steps=3", "checkpoint.every_steps=3")
    assert code == 0, err[-3000:]
    # Another model into the same directory: refused before anything starts, both models named.
    import ray

    other = [f"checkpoint.dir={root}", "train.steps=6", "model.n_layer=3"]
    runs = set((tmp_path / "runs").iterdir())
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--no-progress", f"data.path={small_dataset}",
                                  *FAST, *other, f"cluster.address={ray_cluster}")
    assert code == 2 and not ray.is_initialized() and set((tmp_path / "runs").iterdir()) == runs
    err = without_startup(err)
    first = err.splitlines()[0]
    # one line leading with what differs, then both models and the first few tensors
    assert first == (f"rayzero: error: checkpoint.dir {root} holds a different model: n_layer 2 in the checkpoint, 3 "
                     "here, so 12 tensors differ; train it into another checkpoint.dir, or set checkpoint.resume=none "
                     "to start from scratch beside them")
    assert err.splitlines()[1] == ("  checkpoints of the built-in GPT (n_layer 2, n_head 4, n_embd 64, vocab_size 320); "
                                   "this run trains the built-in GPT (n_layer 3, n_head 4, n_embd 64, vocab_size 320)")
    assert "blocks.2.ln_1.weight: missing from the checkpoint" in err and "… and 8 more" in err
    assert "Traceback" not in err
    # The second way out: from scratch beside them. Its rotation leaves the first model's alone.
    code, out, err, s = train(*other, "checkpoint.resume=none", "checkpoint.every_steps=2", "checkpoint.keep_last=1",
                              name="o.json")
    assert code == 0, err[-3000:]
    assert s["start_step"] == 0 and sorted(p.name for p in root.iterdir()) == ["step-000003", "step-000006"]
    # A prefix without a manifest (a crash mid-upload) is not a checkpoint: skipped, then pruned.
    orphan = root / "step-000005"
    shutil.copytree(root / "step-000003", orphan)
    (orphan / "manifest.json").unlink()
    code, out, err, s = train(f"checkpoint.dir={root}", "train.steps=6", "checkpoint.every_steps=3", name="c.json")
    assert code == 0, err[-3000:]
    assert s["start_step"] == 3 and not orphan.exists(), "the first model's own newest commit, not the other's"
    assert f"rayzero: resuming from {root / 'step-000003'} at step 3 of 6" in err
    # Nothing left to do: said before Ray starts.
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--no-progress", *FAST,
                                    f"data.path={small_dataset}", f"checkpoint.dir={root}", "train.steps=6",
                                    "checkpoint.every_steps=3", "tracking.enabled=false")
    assert code == 0 and not ray.is_initialized(), err
    assert out.strip() == f"nothing to train: {root / 'step-000006'}: it is at step 6 of train.steps=6"


def test_early_stopping_ends_the_run_with_a_commit_and_keeps_the_best(tmp_path, ray_cluster, small_dataset, capsys,
                                                                    monkeypatch):
    """Patience 2 with an improvement no loss can make (min_delta 100): after the baseline
    (step -1) and the evaluations after steps 1 and 3, the run stops after step 3, committing
    that step though it is no checkpoint step, names why, keeps the best commit, and a rerun
    has nothing to train."""
    import ray

    root = tmp_path / "ck"
    args = ["--no-progress", f"data.path={small_dataset}", *FAST, "data.val_fraction=0.1", "train.eval_every=2",
            "train.eval_batches=1", "train.early_stopping_patience=2", "train.early_stopping_min_delta=100",
            "checkpoint.keep_best=val_loss", f"checkpoint.dir={root}", "checkpoint.every_steps=10", "train.steps=40",
            f"train.output_dir={tmp_path / 'runs'}", f"cluster.address={ray_cluster}", "tracking.enabled=true"]
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", *args, "--summary-json",
                                    str(tmp_path / "s.json"))
    assert code == 0, err
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == 4 and s["stopped_early"]["step"] == 3
    assert "in 2 evaluations (train.early_stopping_patience=2)" in s["stopped_early"]["reason"]
    assert [v[0] for v in s["val_losses"]] == [-1, 1, 3]  # the baseline, then every 2 steps
    assert s["checkpoint"] == s["best_checkpoint"] == str(root / "step-000004")
    manifest = json.loads((root / "step-000004" / "manifest.json").read_text())
    assert manifest["metrics"]["val_loss"] == s["best_val_loss"] == s["val_losses"][-1][1]
    assert manifest["early_stopping"]["stopped_after"] == 3
    assert "stopped early after step 3" in out and f"best checkpoint {root / 'step-000004'}" in out
    from mlflow.tracking import MlflowClient

    client = MlflowClient(s["mlflow_tracking_uri"])
    run = client.get_run(s["mlflow_run_id"])
    assert run.data.tags["stopped_early"].startswith("after step 3: no improvement")
    assert sorted(m.step for m in client.get_metric_history(s["mlflow_run_id"], "val_loss")) == [-1, 1, 3]
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", *args)
    assert code == 0 and not ray.is_initialized(), err
    assert out.strip().startswith(f"nothing to train: {root / 'step-000004'}: the run stopped early after step 3")


@pytest.mark.parametrize("case, expected", [
    ("wrong-secret", "ACCESS_DENIED during HeadBucket operation: No response body. (the S3 credentials: "),
    ("no-server", "Could not connect"),
])
def test_unusable_storage_is_found_before_training(tmp_path, small_dataset, s3_server, capsys, monkeypatch,
                                                   case, expected):
    import ray

    s3 = s3_server.overrides()
    if case == "wrong-secret":
        s3 = s3[:2] + ["checkpoint.s3_secret_access_key=not-the-secret"] + s3[3:]
    else:
        s3 = ["checkpoint.s3_endpoint=http://127.0.0.1:9", *s3[1:], "checkpoint.retries=1"]
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--no-progress",
                                    f"data.path={small_dataset}", *FAST, "checkpoint.dir=s3://ckpt/run-x", *s3,
                                    "train.steps=2")
    assert code == 2 and not ray.is_initialized(), "found before any cluster is touched"
    assert "checkpoint.dir: cannot write checkpoints there" in err and expected in err
    assert "not-the-secret" not in out + err


def test_storage_stopped_mid_run_leaves_the_last_commit_intact(tmp_path, ckpt, train):
    import threading
    import time

    from rayzero.checkpoint.tools import list_checkpoints
    from tests.s3server import SeaweedS3

    (tmp_path / "s3").mkdir()
    server = SeaweedS3(tmp_path / "s3")
    server.start()
    try:
        s3 = server.overrides() + ["checkpoint.retries=1"]
        # A rank stuck on dead storage is caught by the watchdog; no restarts: this is about the commit.
        args = ["checkpoint.dir=s3://ckpt/run-s", *s3, "checkpoint.every_steps=2", "cluster.pg_timeout_s=60",
                "failure.max_restarts=0", "failure.phase_timeout_s=10"]
        code, out, err, s = train(*args, "train.steps=4")
        assert code == 0, err[-3000:]

        # Stop the server while the next run trains and uploads (once it has committed past
        # step 4, with most of its 400 steps to go): the run fails, the commit stays.
        storage = load_config(None, s3).checkpoint

        def stop_mid_run():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if any(c["step"] > 4 for c in list_checkpoints("s3://ckpt/run-s", storage)):
                        break
                except Exception:  # noqa: BLE001 (a listing that races an upload: ask again)
                    pass
                time.sleep(0.2)
            server.stop()

        stopper = threading.Thread(target=stop_mid_run, daemon=True)
        stopper.start()
        code, out, err, _ = train(*args, "train.steps=400", name="b.json")
        stopper.join()
        assert code != 0
        server.start()
        code, out, err = ckpt("verify", "s3://ckpt/run-s", *s3)
        assert code == 0, err
        code, out, err, s = train(*args, "train.steps=6", name="c.json")
        assert code == 0, err[-3000:]
        assert s["start_step"] >= 4 and s["resumed_from"].startswith("s3://ckpt/run-s/step-")
    finally:
        server.stop()
