"""What a run keeps out of its output before it starts: Ray's own account of a dead worker
process, which the controller gives in its own words (`failure (rank_died): ...`); the killed
rank's run through the CLI: tests/e2e/test_failures.py."""

from ray._private import worker as ray_worker

from rayzero.jobs.preflight import quiet_logs

DIED = ("A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the "
        "problem, check the logs for the dead worker. RayTask ID: ffff Worker exit type: SYSTEM_ERROR Worker exit "
        "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some potential root "
        "causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force is "
        "called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors.")


def test_the_raylets_report_of_a_dead_worker_stays_out_of_the_output(capsys, monkeypatch):
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored after
    quiet_logs()
    quiet_logs()  # once only
    # as Ray's error listener calls it, looking the function up by name when a message arrives
    ray_worker.print_to_stdstream({"lines": [DIED], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert "OOM killer" not in capsys.readouterr().out
    other = "The node with node id: abc has been marked dead because the detector has missed too many heartbeats."
    ray_worker.print_to_stdstream({"lines": [DIED, other], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out = capsys.readouterr().out
    assert other in out and "OOM killer" not in out, "Ray's other messages print as they did"
