"""The team path on one machine: the session's Ray head (token authentication), SeaweedFS for S3
and an `mlflow server`. A job submitted with `ray job submit`, its S3 keys only in its own
command's environment (`env AWS_...=... rayzero train ...`: the ranks, processes Ray starts for
the job, never see them), reads its data from S3 and commits its checkpoints there; the MLflow
server is down while it runs (what the job logs stays in its run directory, the run itself
too), and the job is stopped (`ray job stop`, SIGTERM) at its first commit; the server comes up
and the same job is submitted again. At the end: one MLflow run with
one point per step, `history.jsonl` with one row per step, and the final weights bitwise those
of an unbroken run."""

import json
import time

import pyarrow.fs as pafs
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load

from tests.conftest import free_port
from tests.e2e.conftest import MlflowServer
from tests.e2e.faults import wait_for
from tests.s3server import without_aws_variables

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 32  # the stop must come before the end: it is sent at the first commit (step 4)
RUN = ["--no-progress", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64",
       "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2", f"train.steps={STEPS}",
       "data.path=s3://team/data", "tracking.flush_timeout_s=2"]


def weights(fs, path: str) -> dict[str, torch.Tensor]:
    with fs.open_input_stream(path) as f:
        return load(f.read())


def test_a_job_stopped_and_resubmitted_with_mlflow_down_for_a_while_ends_as_one_run(
        tmp_path, ray_head, s3_server, small_dataset, train_here, monkeypatch):
    from ray.job_submission import JobStatus, JobSubmissionClient

    without_aws_variables(monkeypatch)
    keys = {"AWS_ACCESS_KEY_ID": s3_server.KEY, "AWS_SECRET_ACCESS_KEY": s3_server.SECRET,
            "AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_DEFAULT_REGION": s3_server.REGION}
    fs = s3_server.fs()
    pafs.copy_files(small_dataset, "team/data", destination_filesystem=fs)

    # the unbroken run, in this process (its keys in this process's environment, for its checks)
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    code, _, err, _ = train_here(*RUN, "checkpoint.dir=s3://team/unbroken", "tracking.enabled=false",
                                 f"train.output_dir={tmp_path / 'unbroken'}",
                                 "train.save_final=s3://team/unbroken.safetensors", summary="unbroken.json")
    assert code == 0, err[-3000:]
    from rayzero import release_ranks

    release_ranks()  # the jobs need the head's CPUs
    for name in keys:
        monkeypatch.delenv(name)

    port = free_port()  # the MLflow server's; down until the first job has ended
    (tmp_path / "mlflow").mkdir()
    server = MlflowServer(tmp_path / "mlflow", port=port)
    runs = tmp_path / "runs"
    entrypoint = " ".join(["env", *(f"{k}={v}" for k, v in keys.items()), "rayzero", "train", *RUN,
                           "checkpoint.dir=s3://team/ckpt", "checkpoint.every_steps=4", f"train.output_dir={runs}",
                           f"tracking.uri=http://127.0.0.1:{port}", "train.save_final=s3://team/final.safetensors"])
    jobs = JobSubmissionClient(ray_head.dashboard)
    # a stop gives the job time to end its iteration, as Kubernetes gives a pod (30 s), not Ray's 3 s
    runtime = {"working_dir": str(tmp_path), "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}

    def submit() -> str:
        """The job submitted; a head just started takes a moment to have a job agent."""
        deadline = time.monotonic() + 60
        while True:
            try:
                return jobs.submit_job(entrypoint=entrypoint, runtime_env=runtime)
            except RuntimeError as e:
                if "No available agent" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def finished(job: str):
        status = jobs.get_job_status(job)
        return status if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) else None

    first = submit()

    def commits():
        return [i.path for i in fs.get_file_info(pafs.FileSelector("team/ckpt", allow_not_found=True, recursive=True))
                if i.path.endswith("manifest.json")]

    wait_for(commits, 300, "the first job's first commit")
    jobs.stop_job(first)
    assert wait_for(lambda: finished(first), 120, "the stopped job to end") == JobStatus.STOPPED
    logs = jobs.get_job_logs(first)
    assert "rayzero: terminated (SIGTERM): stopped at step" in logs, logs[-3000:]
    assert "last checkpoint s3://team/ckpt/step-" in logs and "Traceback" not in logs
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    assert (run_dir / "mlflow-unsent.json").exists(), "what the server did not take is kept"

    server.start()
    second = submit()
    assert wait_for(lambda: finished(second), 300, "the resubmitted job") == JobStatus.SUCCEEDED, \
        jobs.get_job_logs(second)[-3000:]
    logs = jobs.get_job_logs(second)
    assert "rayzero: resuming from s3://team/ckpt/step-" in logs
    try:
        client = MlflowClient(server.uri)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(STEPS))
        assert not (run_dir / "mlflow-unsent.json").exists()
    finally:
        server.stop()
    rows = [json.loads(line)["step"] for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert rows == list(range(STEPS)), "one row per step"
    a, b = weights(fs, "team/unbroken.safetensors"), weights(fs, "team/final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "bitwise the unbroken run"
