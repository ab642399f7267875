"""The end-to-end tier's shared pieces: one real Ray head node for the whole pytest session (on
loopback, with token authentication, as `ray start` makes one), the CLI as a user runs it, an
MLflow server, and a check after every test that used the cluster that it left nothing there.

Every run here joins that one head (`cluster.address=…`, or `RAY_ADDRESS` in the CLI's
environment, as `ray job submit` gives a job); only the test of starting Ray itself
(`rayzero train` with no address) and the elastic test (a 2-node cluster it takes nodes from)
start a Ray of their own."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import cli_in_process, free_port

BIN = Path(sys.executable).parent
KEEP = "cluster.keep_ranks=true"  # see `train_here`


def run_cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rayzero ARGS…` exactly as a user types it, in a process of its own."""
    return subprocess.run(
        [str(BIN / "rayzero"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "RAY_AUTH_MODE": "token", **(env or {})},
    )


@pytest.fixture
def train_here(tmp_path, ray_cluster, capsys, monkeypatch, caplog):
    """`rayzero train ARGS…` by the CLI's `main` in this process, from `tmp_path`, on the
    session's cluster, for tests of what a run does rather than of the entry point (a `rayzero`
    process costs about 5 s more: imports and a driver of its own): (exit code, stdout, stderr
    followed by the log records so far, the summary of a run that succeeded, else None).

    Its runs keep their rank processes (`cluster.keep_ranks`, KEEP) for the next one placed
    alike, in this test or a later one: a run then starts no process and imports nothing (4 s
    of a GPT's run on 2 ranks here, 12 s of a Llama's). A test that does not use this fixture
    starts with them released (`leaves_nothing_on_the_cluster`)."""
    def run(*args: str, summary: str = "s.json"):
        code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--no-progress", "--summary-json",
                                        str(tmp_path / summary), f"cluster.address={ray_cluster}", KEEP, *args)
        return code, out, err + caplog.text, (json.loads((tmp_path / summary).read_text()) if code == 0 else None)
    return run


class RayHead:
    """A `ray start --head` on loopback: its GCS address and its dashboard (job) URL."""

    def __init__(self, address: str, dashboard: str):
        self.address, self.dashboard = address, dashboard


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A 2-CPU head node with token authentication, as a user starts one from an activated
    venv (so `rayzero` is on the PATH of the jobs it runs); stopped, with everything on it,
    at the end."""
    port, dashboard_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    temp = tmp_path_factory.mktemp("ray")
    # A fresh machine has no token yet and `ray start` refuses to run without one; this makes
    # one only if none exists (its output, the token, is not shown).
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, capture_output=True,
                   check=True, timeout=60)
    started = subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--port={port}", f"--dashboard-port={dashboard_port}",
         "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp}"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    if started.returncode != 0:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"ray start failed:\n{started.stdout[-2000:]}\n{started.stderr[-3000:]}")
    head = RayHead(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}")
    _dashboards[head.address] = head.dashboard
    try:
        yield head
    finally:
        import ray

        from rayzero import release_ranks

        release_ranks()
        if ray.is_initialized():  # a driver left connected would outlive its head
            ray.shutdown()
        kill_ray(temp, port)


def kill_ray(temp: Path, port: int) -> None:
    """Every process of one Ray, found by what its command line names (its `--temp-dir`, or
    its GCS port as `--address=IP:PORT`: the client server names only that), and all their
    descendants (workers, job drivers: their titles are Ray's own), killed and waited for.
    `ray stop --force` does as much for every Ray on the machine, in three rounds a second or
    two apart (7 s)."""
    import psutil

    own = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        args = p.info["cmdline"] or ()
        if p.pid not in own and any(str(temp) in a or (a.startswith("--address=") and a.endswith(f":{port}"))
                                    for a in args):
            found[p.pid] = p
            try:
                found.update({c.pid: c for c in p.children(recursive=True) if c.pid not in own})
            except psutil.NoSuchProcess:
                pass
    for p in found.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(found.values()), timeout=30)
    assert not alive, f"Ray processes that outlived SIGKILL: {alive}"


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """The address of the head node above."""
    return ray_head.address


_dashboards: dict[str, str] = {}  # GCS address -> dashboard URL, of the heads started here


# Ray Data's own singletons, detached by design and kept for the cluster's life: Ray's, not a run's.
RAY_SYSTEM_ACTORS = {"_StatsActor", "ActorLocationTracker", "_UsageCollectionActor", "_AutoscalingCoordinatorActor"}


def _state(address: str) -> tuple[list, list, list]:
    """What is live on the cluster, read in this process through Ray's state API (HTTP to the
    dashboard; no `ray.init`, no new process): actors (Ray's own singletons aside), placement
    groups not removed, unfinished jobs (drivers still connected, submissions pending or running)."""
    from ray.util.state import list_actors, list_jobs, list_placement_groups

    where = _dashboards.get(address, address)
    actors = [x for x in list_actors(address=where, filters=[("state", "!=", "DEAD")], limit=1000)
              if x.class_name not in RAY_SYSTEM_ACTORS]
    groups = [x for x in list_placement_groups(address=where, limit=1000) if x.state != "REMOVED"]
    jobs = [x for x in list_jobs(address=where, limit=1000)
            if str(x.status).rpartition(".")[2] in ("PENDING", "RUNNING")]
    return actors, groups, jobs


def leftovers(address: str) -> tuple[list, list]:
    """Live actors (by class) and unremoved placement groups on the cluster."""
    actors, groups, _ = _state(address)
    return [x.class_name for x in actors], [x.placement_group_id for x in groups]


def _live(address: str, but: set[str] = frozenset()) -> set[str]:
    """Everything live on the cluster, by id, but the ids in `but`."""
    actors, groups, jobs = _state(address)
    return ({f"actor {x.actor_id} ({x.class_name})" for x in actors if x.actor_id not in but}
            | {f"placement group {x.placement_group_id}" for x in groups if x.placement_group_id not in but}
            | {f"job {x.submission_id or x.job_id} ({x.type}, {x.entrypoint!r})" for x in jobs
               if x.job_id not in but})


def kept() -> set[str]:
    """The ids of what `cluster.keep_ranks` keeps on the cluster for this process's next run:
    the kept rank actors and rollout actors, their placement groups, and this process's driver
    (job), which stays connected for them."""
    import ray

    from rayzero.cluster.worker_group import KEPT

    group = KEPT.group
    if group is None or not ray.is_initialized():
        return set()
    _, pg, actors = KEPT.rollouts or (None, None, [])
    return ({a._actor_id.hex() for a in [*group.actors, *actors]} | {group.pg.id.hex()}
            | ({pg.id.hex()} if pg is not None else set()) | {ray.get_runtime_context().get_job_id()})


@pytest.fixture(autouse=True)
def leaves_nothing_on_the_cluster(request):
    """Every test that used the session's cluster leaves no actor, placement group or
    unfinished job there (what it found already there, left by a test that failed, is not
    its own), but the ranks its runs kept for the next test's (`train_here`). A test that does
    not run through `train_here` starts with those released: with nothing of this process's on
    the cluster. A driver's exit reaches the GCS a moment after the process ends, so the check
    waits up to 10 s for the state to settle before it fails."""
    if not {"ray_cluster", "ray_head"} & set(request.fixturenames):
        yield
        return
    if "train_here" not in request.fixturenames:
        from rayzero import release_ranks

        release_ranks()
    address = request.getfixturevalue("ray_head").address
    before = _live(address)
    yield
    deadline = time.monotonic() + 10
    while (left := _live(address, but=kept()) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left on the cluster: {sorted(left)}"


class MlflowServer:
    """`mlflow server` on loopback with a sqlite store, as a team runs one."""

    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = root, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--workers", "1", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=open(self.root / "server.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not start; see {self.root / 'server.log'}")

    def stop(self, graceful: bool = True):
        """SIGTERM (its workers finish what they serve) or, at the session's end, SIGKILL."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One running MLflow server for the tests that only log to it (each in an experiment of
    its own); a test that stops or freezes its server starts its own."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    try:
        yield server
    finally:
        server.stop(graceful=False)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, ray_cluster, small_dataset):
    """The failure tests' uninterrupted run (`faults.RUN`), made once for every test that ends on it."""
    from tests.e2e.faults import NoFault, Reference, STEPS, controller_run

    tmp = tmp_path_factory.mktemp("reference")
    controller, error = controller_run(tmp, ray_cluster, small_dataset, NoFault)
    assert error is None, error
    assert not controller.failures and controller.summary_["steps"] == STEPS
    losses = {k: v["loss"] for k, v in controller.tracker.metrics.items() if "loss" in v}
    assert sorted(losses) == list(range(STEPS))
    return Reference(tmp / "final.safetensors", losses)
