import os
import random
import socket
import sys
from pathlib import Path

# The e2e clusters use Ray's token authentication (what `ray start` turns on); Ray reads the
# mode when it is first imported, so it is set before any test module imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# No test may reach a model hub: transformers and huggingface_hub fail at once instead of retrying.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from rayzero.data.tokens import prepare
from tests.s3server import SeaweedS3


_taken: set[int] = set()


def free_port() -> int:
    """A port to rendezvous on, free now, and below the ephemeral range: the kernel hands
    ephemeral ports to every outgoing connection and to gloo's own listeners, so a port taken
    from that range (bind to 0) can be in use again by the time a process group binds it, and
    its ranks then wait on the wrong listener. Never the same port twice in one session."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> str:
    """~400k tokens of the stdlib's `json`, `email` and `asyncio` sources, as a prepared dataset."""
    src = Path(sys.modules["json"].__file__).parent.parent
    out = tmp_path_factory.mktemp("data") / "small"
    texts = tmp_path_factory.mktemp("texts")
    for pkg in ("json", "email", "asyncio"):
        for f in sorted((src / pkg).glob("*.py")):
            (texts / f"{pkg}_{f.name}").write_text(f.read_text())
    prepare(texts, str(out), pattern="*.py", row_group_tokens=1 << 14)
    return str(out)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server for the session, stopped (and its data removed) at the end."""
    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
