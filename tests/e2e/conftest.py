"""A real Ray head node on loopback with token authentication, as `ray start` makes one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

BIN = Path(sys.executable).parent


def run_cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rayzero ARGS…` exactly as a user types it."""
    return subprocess.run(
        [str(BIN / "rayzero"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "RAY_AUTH_MODE": "token", **(env or {})},
    )


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
    try:
        yield RayHead(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}")
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """The address of the head node above."""
    return ray_head.address


def leftovers(address: str) -> tuple[list, list]:
    """Live actors and unremoved placement groups on the cluster, read through Ray's state API."""
    code = (
        "import ray, json\n"
        "from ray.util.state import list_actors, list_placement_groups\n"
        f"ray.init(address={address!r}, logging_level='ERROR')\n"
        "a = [x.class_name for x in list_actors() if x.state != 'DEAD']\n"
        "p = [x.placement_group_id for x in list_placement_groups() if x.state != 'REMOVED']\n"
        "print(json.dumps([a, p]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_AUTH_MODE": "token"}, check=True)
    import json

    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))
