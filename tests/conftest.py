import os
import random
import sys
import time
from pathlib import Path

# The e2e clusters use Ray's token authentication (what `ray start` turns on); Ray reads the
# mode when it is first imported, so it is set before any test module imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# No test may reach a model hub: transformers and huggingface_hub fail at once instead of retrying.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from rayzero.data.tokens import prepare
from rayzero.workers.rendezvous import rendezvous_port
from tests.s3server import SeaweedS3


_taken: set[int] = set()
_started: dict[str, float] = {}


def pytest_sessionstart(session):
    _started["wall"], _started["epoch"] = time.monotonic(), time.time()


def pytest_runtest_setup(item):
    """Past the gloo tier, its kept rank processes only cost CPU: end them."""
    pool = sys.modules.get("tests.dist.pool")
    if pool is not None and "dist" not in Path(str(item.path)).parent.parts[-1:]:
        pool.close()


def pytest_terminal_summary(terminalreporter):
    """The suite's wall time, on a line of its own before pytest's closing line; under
    `.ci/run` (which exports when it began) also the install's time before it."""
    wall = time.monotonic() - _started["wall"]
    line = f"wall time of the tests: {wall:.0f} s ({wall / 60:.1f} min)"
    began = os.environ.get("RAYZERO_CI_STARTED")
    if began:
        line += f"; install before them: {_started['epoch'] - float(began):.0f} s"
    terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """What the session started in this process ends before the interpreter does: the kept rank
    processes, the Ray driver (its head may be gone already) and any gloo group a test left, whose
    threads would otherwise still run while Python finalizes. Past pytest's own fault handler, a
    crash in the interpreter's exit still prints every thread's stack."""
    pool = sys.modules.get("tests.dist.pool")
    if pool is not None:
        pool.close()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    import faulthandler

    faulthandler.enable(file=sys.__stderr__, all_threads=True)


def free_port() -> int:
    """A port to rendezvous on, free now and below the ephemeral range (as rank 0 picks
    its own, `rendezvous_port`); never the same port twice in one session."""
    rng = random.Random()
    for _ in range(1000):
        port = rendezvous_port("127.0.0.1", rng)
        if port not in _taken:
            _taken.add(port)
            return port
    raise RuntimeError("no free port")


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
    """One SeaweedFS S3 server for the session, killed (and its data removed) at the end."""
    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop(graceful=False)


def without_startup(err: str) -> str:
    """What a `rayzero train` said on stderr besides its start-up's status lines (`rayzero: [
    0.0s] checking …`, said before the checks a bad input fails)."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("rayzero: ["))


def cli_in_process(capsys, monkeypatch, cwd: Path, *argv: str) -> tuple[int, str, str]:
    """`rayzero ARGV…` run by its `main` in this process, from `cwd`: (exit code, stdout,
    stderr). For paths where the process itself is not what is tested; an exception that `main`
    does not turn into a message propagates (it would have been a traceback)."""
    from rayzero.jobs import cli

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err

