"""The Ray a run starts on this machine, or joins: whether it starts one, whether it fits, whether
a cluster's address answers, what Ray's start-up says, and the start (or the join) begun beside
the driver's checks, the ranks' placement after it (`RayStart`).

Standard library at import (Ray and torch are imported by the functions that need them): the
CLI, in a process of its own, begins Ray's start before it imports torch and the model code.
Measured on 2 cores (`benchmarks/startup.py`): the driver's imports take 1.1-1.5 s and a local
`ray.init()` 2.5-4 s, most of it Ray's own processes starting (GCS, raylet, its dashboard's
minimal head), which run on the other core while the driver imports and checks.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

log = logging.getLogger(__name__)


def starts_local_ray(cfg) -> bool:
    """Whether a run of `cfg` from here starts a Ray of its own on this machine (no
    `cluster.address`, no RAY_ADDRESS, none running in this process)."""
    import ray

    return not cfg.cluster.address and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized()


def local_capacity(gpus: bool = True) -> dict[str, float]:
    """The CPUs and GPUs a local Ray started here gets (Ray's own count, cgroup limits included).
    `gpus=False`: the GPUs are not counted (0), and torch is not imported for them."""
    try:
        from ray._private.utils import get_num_cpus

        cpus = float(get_num_cpus())
    except Exception:  # noqa: BLE001 (Ray's internals moved: count the CPUs this process may use)
        cpus = float(len(os.sched_getaffinity(0)))
    if not gpus:
        return {"CPU": cpus, "GPU": 0.0}
    import torch

    return {"CPU": cpus, "GPU": float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0}


def check_local_capacity(cfg) -> None:
    """A run that starts its own Ray must fit this machine: otherwise placement would only
    fail after `cluster.placement_timeout_s`. ConfigError naming what is asked and what there is."""
    from rayzero.config import ConfigError

    c = cfg.cluster
    have = local_capacity(gpus=c.use_gpu)
    smallest = min(cfg.world_sizes())
    need = c.bundle
    for kind, each in need.items():
        if smallest * each > have[kind] + 1e-9:
            ask = (f"cluster.num_workers={c.num_workers} x {each:g} {kind}"
                   + (" (cluster.cpus_per_worker)" if kind == "CPU" else " each (cluster.use_gpu)"))
            fits = int(have[kind] / each + 1e-9)
            fewer = (f"use at most {fits} worker{'s' if fits != 1 else ''}"
                     + (", or a smaller cluster.cpus_per_worker" if kind == "CPU" else ""))
            raise ConfigError(
                f"cluster.num_workers: {ask} = {c.num_workers * each:g} {kind}s, but this machine's local Ray has "
                f"{have[kind]:g}; {fewer + ', or ' if fits else ''}set cluster.address to run on a Ray cluster")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a host:port nobody listens on (ray.init would retry for minutes), and on a
    cluster that refuses this process's authentication (ray.init would print Ray's refusal
    every second for 20 s, then say only that it cannot connect)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "", "auto", or a form ray.init resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"{host}:{port} is not reachable ({e})") from None
    if not address.startswith("ray://"):  # a GCS address: ask it, as ray.init will, once
        _check_authentication(f"{host}:{port}", timeout_s)


def _check_authentication(gcs: str, timeout_s: float) -> None:
    """One GCS call with this process's credentials (RAY_AUTH_MODE=token: its token): a
    refusal is a ConnectionError that says what to set. Anything else is left to ray.init."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return
    token = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    metadata = ()
    if token:
        try:
            from ray._private.authentication.grpc_authentication_client_interceptor import (
                _get_authentication_metadata_tuple,
            )
            metadata = _get_authentication_metadata_tuple()
        except Exception:  # noqa: BLE001 (Ray's internals moved: ray.init checks the token itself)
            return
    with grpc.insecure_channel(gcs) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                return
            where = ("the token `ray get-auth-token` prints on its head node, as RAY_AUTH_TOKEN or in "
                     "~/.ray/auth_token")
            raise ConnectionError(
                f"the cluster uses token authentication and refused this process's token: give it {where}"
                if token else
                f"the cluster uses token authentication: export RAY_AUTH_MODE=token before the command, with "
                f"{where}") from None


def local_ray_options(cfg) -> dict:
    """`ray.init`'s options for a run of `cfg` from here: where it starts a Ray of its own
    (`starts_local_ray`), no dashboard unless `cluster.dashboard` asks for one (it costs about
    2 s of the start and a run needs none of it); a cluster the run joins is left as it is."""
    return {"include_dashboard": False} if starts_local_ray(cfg) and not cfg.cluster.dashboard else {}


def shutdown_ray() -> None:
    """ray.shutdown(), whole: a Ctrl-C then is ignored, as the run has ended (or is ending) and
    nothing is left to stop, and a Ray shut down halfway would get in the way of the next run in
    this process."""
    import ray

    if threading.current_thread() is not threading.main_thread():
        ray.shutdown()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ray.shutdown()
    finally:
        signal.signal(signal.SIGINT, previous)


class RayStart:
    """A run's Ray, its start begun in a thread of its own while the driver goes on with its
    imports and checks: a local Ray started, or a running one joined (`cluster.address`,
    RAY_ADDRESS). Once Ray is up, the same thread begins placing the run's ranks and starting
    their processes (`place_ahead`), which the run's placement then takes. `wait()` where the
    run needs Ray, `stop()` when the run ends (a refusal found after the start began included:
    what was started is shut down, nothing left behind).

    The thread lives as long as a local Ray it started: Ray's processes are started with the
    kernel's parent-death signal (PR_SET_PDEATHSIG), which Linux sends when the *thread* that
    started them ends. So it waits until Ray is shut down (the run's end, or the release of
    ranks a notebook kept) or until `stop()`."""

    def __init__(self, options: dict, cfg=None, clock=lambda: 0.0, joins: str | None = None):
        """`ray.init(**options)`; `cfg`: the run's, whose ranks are placed once Ray is up (None:
        they are not); `clock()`: seconds since the run's start; `joins`: the address of the Ray
        it joins ("" for RAY_ADDRESS's; None: it starts one here)."""
        self._options, self._cfg, self._clock, self._joins = options, cfg, clock, joins
        self.began_s = clock()  # when it began, in the run's start-up clock (said in the Ray stage's line)
        self._ready = threading.Event()
        self._release = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._keep, name="rayzero-ray-start", daemon=True)
        self._thread.start()

    @classmethod
    def begin(cls, cfg, clock=lambda: 0.0) -> "RayStart | None":
        """The start of the Ray a run of `cfg` needs, begun: a local one (a run that would not
        fit this machine is refused first, ConfigError, before anything starts), or the cluster
        at `cluster.address` or RAY_ADDRESS joined; None where this process is connected to a
        Ray already. `clock()`: seconds since the run's start."""
        import ray

        if ray.is_initialized():
            return None
        options = {"logging_level": "WARNING", "log_to_driver": True}
        quiet_logs()
        if starts_local_ray(cfg):
            check_local_capacity(cfg)
            return cls({**options, **local_ray_options(cfg)}, cfg, clock)
        return cls({**options, "address": cfg.cluster.address or None}, cfg, clock,
                   joins=cfg.cluster.address or os.environ.get("RAY_ADDRESS", ""))

    def _keep(self) -> None:
        import ray

        try:
            if self._joins is not None:
                check_reachable(self._joins)  # an address nobody listens on fails now, not after minutes
            ray.init(**self._options)
            ahead = False
            if self._cfg is not None:  # before `wait` returns: the run's placement waits for it
                from rayzero.cluster.worker_group import begin_ahead, place_ahead

                ahead = begin_ahead(self._cfg, self._clock())
        except BaseException as e:  # noqa: BLE001 (given to the run by wait(); the thread's end stops the rest)
            self._error = e
            return
        finally:
            self._ready.set()
        if ahead:
            place_ahead(self._cfg)
        while self._joins is None and not self._release.wait(1.0) and ray.is_initialized():
            pass  # a local Ray's processes end with the thread that started them

    def wait(self) -> None:
        """Until Ray is up; raises what `ray.init` (or the address's check) raised."""
        self._ready.wait()
        if self._error is not None:
            raise self._error

    # Whether a RayStart was left starting by `stop`: the program then ends its process at once
    # (`cli.command`), which ends what Ray had started with it.
    abandoned = False

    def stop(self) -> None:
        """Shut the Ray it started down, and end the thread. A start still under way is not
        waited for (a refusal or a Ctrl-C during the checks ends the command at once; a Ctrl-C
        that cut an import short may even leave it stuck on the import lock): the processes it
        has started so far are killed, and what it starts after that ends with this process,
        whose end the kernel passes on to them (PR_SET_PDEATHSIG). The CLI, in a process of its
        own, is the one user: it ends at once after this (`cli.command`)."""
        if not self._ready.is_set():
            RayStart.abandoned = True
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: nothing cut short
            try:
                for _ in range(2):  # the raylet may have started its agents while the first pass ran
                    for pid in descendants(os.getpid()):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
            finally:
                signal.signal(signal.SIGINT, previous)
            return
        if self._error is None:
            shutdown_ray()
        self._release.set()
        self._thread.join(timeout=10.0)


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (its children, theirs, ...), from /proc; parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


class _DropNotice(logging.Filter):
    """Drops the log records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


# Ray's notes at a start that say nothing a user must act on: token authentication being on
# (its warning that it is off stays), and, for `RayStart`'s start off the main thread, that
# Ray set no SIGTERM handler (the CLI's and the controller's handle SIGTERM: cli._on_sigterm).
QUIET = {"ray._private.authentication.authentication_token_setup": ("Token authentication is enabled",),
         "ray._private.worker": ("SIGTERM handler is not set because current thread is not the main thread",)}


def quiet_logs() -> None:
    """Keep the libraries' routine start-up notes out of a run's output: Ray's (`QUIET`), and
    MLflow's creation of a new sqlite store's tables; and Ray's own account of a rank process
    that died (`_worker_deaths`). Idempotent."""
    for name, prefixes in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in logger.filters):
            logger.addFilter(_DropNotice(*prefixes))
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _worker_deaths()


# How the raylet tells a driver that one of its worker processes died (killed, crashed): a
# paragraph guessing at causes ("... killed by SIGKILL by OOM killer due to high memory usage
# ...") printed to stdout, while the controller says which rank died, at what step, and what it
# does about it, in its own words (`failure (rank_died): ...`).
WORKER_DIED = ("A worker died or was killed while executing a task", "Worker unexpectedly exits with a connection error")


def _worker_deaths() -> None:
    """Ray's driver prints the raylet's error messages through `print_to_stdstream`, looked up
    by name when one arrives: the raylet's report of a dead worker goes to the log at debug
    level instead (Ray's other messages print as they would). Installed once."""
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "keeps_out_worker_deaths", False):
        return

    def printing(data, ignore_prefix):
        if data.get("pid") == "raylet":
            dropped = [line for line in data.get("lines", []) if any(m in line for m in WORKER_DIED)]
            for line in dropped:
                log.debug("Ray: %s", line)
            if dropped:
                data = {**data, "lines": [line for line in data["lines"] if line not in dropped]}
                if not data["lines"]:
                    return None
        return original(data, ignore_prefix)

    printing.keeps_out_worker_deaths = True
    ray_worker.print_to_stdstream = printing
