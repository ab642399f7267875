"""What a run settles before it starts: Ray's own account of a dead worker process kept out of
its output (the controller gives it in its own words, `failure (rank_died): ...`; the killed
rank's run through the CLI: tests/e2e/test_failures.py), and a cluster it cannot reach leaving
nothing behind."""

import ray
from ray._private import worker as ray_worker

from rayzero.jobs import cli
from rayzero.cluster.local_ray import quiet_logs

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


def test_a_cluster_that_cannot_be_reached_leaves_no_run_directory(tmp_path, capsys):
    code = cli.main(["train", "--no-progress", "cluster.address=127.0.0.1:9", f"train.output_dir={tmp_path / 'runs'}",
                     "model.n_layer=1", "model.n_embd=32", "model.n_head=4", "checkpoint.dir="])
    err = capsys.readouterr().err
    assert code == 2 and "cluster.address: cannot connect to a Ray cluster at '127.0.0.1:9'" in err, err
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "no run directory left"


def test_a_sigterm_during_the_checks_stops_with_one_line_and_exit_143(tmp_path, capsys, monkeypatch):
    """`ray job stop` (or a pod stopped) while the run is still checking its inputs: one line,
    the shell's code for SIGTERM, nothing started (the controller takes SIGTERM over while it
    trains: tests/e2e/test_cli.py)."""
    import os
    import signal

    from rayzero.jobs import train

    def sigterm_while_checking(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal ends the checks")

    monkeypatch.setattr(train, "resolve_data", sigterm_while_checking)
    before = signal.getsignal(signal.SIGTERM)
    code = cli.main(["train", "--no-progress", f"train.output_dir={tmp_path / 'runs'}", "checkpoint.dir="])
    assert code == 143 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "rayzero: terminated (SIGTERM): stopped before training began")
    assert signal.getsignal(signal.SIGTERM) is before and not ray.is_initialized()
