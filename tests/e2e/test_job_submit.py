"""`ray job submit -- rayzero train …` on a running cluster: a job that fails, and a submission
without the token. The README's own submission, a job that trains and succeeds (its log streamed
back, its status, its logs, its checkpoint), runs in test_examples.py, in the order of its guide's page."""

import os
import re
import subprocess

import pytest

from tests.e2e.conftest import BIN

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB = ["--no-progress", "cluster.address=auto", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
       "train.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=12",
       "checkpoint.every_steps=6", "tracking.enabled=false"]  # MLflow is tested on its own


def ray_cli(*args: str, token: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `ray` command, its output without colour codes."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"} if token else {
        k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    r = subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True, timeout=timeout, env=env)
    r.stdout, r.stderr = (re.sub(r"\x1b\[[0-9;]*m", "", t) for t in (r.stdout, r.stderr))
    return r


def submit(ray_head, workdir, *entrypoint: str, token: bool = True) -> subprocess.CompletedProcess:
    return ray_cli("job", "submit", "--address", ray_head.dashboard, "--working-dir", str(workdir), "--",
                   *entrypoint, token=token)


def job_id(output: str) -> str:
    return next(line.split("'")[1] for line in output.splitlines() if "Job '" in line)


def test_a_failing_job_is_failed_with_its_cause_in_the_log(tmp_path, ray_head, small_dataset):
    r = submit(ray_head, tmp_path, "rayzero", "train", f"data.path={small_dataset}",
               f"train.output_dir={tmp_path / 'runs'}", *JOB, "sharding.strategy=zero9")
    assert r.returncode != 0
    jid = job_id(r.stdout + r.stderr)
    status = ray_cli("job", "status", "--address", ray_head.dashboard, jid)
    assert f"Job '{jid}' failed" in status.stdout, status.stdout + status.stderr
    logs = ray_cli("job", "logs", "--address", ray_head.dashboard, jid).stdout
    assert "rayzero: error: invalid config:" in logs and "sharding.strategy" in logs, r.stdout + logs


def test_a_submission_without_the_token_is_refused_clearly(tmp_path, ray_head):
    r = submit(ray_head, tmp_path, "rayzero", "train", "--dry-run", token=False)
    assert r.returncode != 0
    text = (r.stdout + r.stderr).lower()
    assert "token" in text or "auth" in text, r.stdout[-2000:] + r.stderr[-2000:]
