"""What a user would pick instead of rayzero, hosted for `step_time.py` one point at a time:
torchrun-style DDP and FSDP2 in spawned processes, and Ray Train's `TorchTrainer` with each;
and how a point's peak RSS is measured, in these processes and in rayzero's rank actors alike.

A point (duck-typed: `overrides`, `steps`, `warmup`) is sent to a run's processes, which build
`plain.PlainTrainer` for it, time its steps, and report rank 0's step times and every rank's
peak RSS.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.multiprocessing as mp

import plain
from rayzero.config import load_config


# -- peak RSS of one point ---------------------------------------------------------------

def trim() -> None:
    """Give freed heap back to the system: before a point, so that its peak RSS is its own
    (Ray Train's workers keep their processes across points), and after one."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def reset_peak() -> None:
    trim()
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    global _base
    _base = _status("VmRSS:")


_base = 0.0


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key}")


def peak_mib() -> tuple[float, float]:
    """The peak RSS since `reset_peak`, and its growth over the RSS then (what the point
    itself took: the process's runtime, torch's and Ray's, is left out)."""
    peak = _status("VmHWM:")
    return peak, peak - _base


def run_plain_point(cfg, data_path: str, fsdp2: bool, warmup: int, wrap=None) -> dict:
    """One point on this rank of a plain run; rank 0's step times, every rank's peak RSS."""
    import torch.distributed as dist

    reset_peak()
    trainer = plain.PlainTrainer(cfg, data_path, fsdp2=fsdp2, wrap=wrap)
    times, losses = trainer.run(cfg.train.steps)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_mib())
    trainer.close()
    del trainer
    trim()  # idle until the next point: 16 processes of a few GiB each do not fit this machine
    return {"step_s": times, "losses": losses.tolist(),
            "peak_rss_mib": [p[0] for p in peaks], "growth_mib": [p[1] for p in peaks]}


# -- plain torch in spawned processes --------------------------------------------------------

def _plain_worker(rank: int, world: int, fsdp2: bool, port: int, data_path: str, inbox, outbox, wrap=None) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while (cmd := inbox[rank].get()) is not None:
        if cmd == "ping":
            if rank == 0:
                outbox.put("ready")
            continue
        cfg = load_config(None, cmd["overrides"])
        result = run_plain_point(cfg, data_path, fsdp2, cmd["warmup"], wrap=wrap)
        if rank == 0:
            outbox.put(result)
    dist.destroy_process_group()


class PlainRun:
    """`wrap`: what wraps the model instead of DDP (`plain.alone`: nothing, no communication)."""

    def __init__(self, world: int, fsdp2: bool, data_path: str, wrap=None):
        ctx = mp.get_context("spawn")
        self.inbox = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_plain_worker,
                                  args=(r, world, fsdp2, port, data_path, self.inbox, self.outbox, wrap))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def ready(self) -> None:
        for q in self.inbox:
            q.put("ping")
        assert self.outbox.get(timeout=600) == "ready"

    def run(self, point) -> dict:
        for q in self.inbox:
            q.put({"overrides": _overrides(point), "warmup": point.warmup})
        return self.outbox.get(timeout=3600)

    def close(self) -> None:
        for q in self.inbox:
            q.put(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def _overrides(point) -> list[str]:
    return [*point.overrides, f"train.steps={point.steps}"]


# -- Ray Train ---------------------------------------------------------------------------

def _ray_train_loop(config: dict) -> None:
    import torch.distributed as dist
    import ray.train.torch

    torch.set_num_threads(1)
    inbox, outbox, fsdp2 = config["inbox"], config["outbox"], config["fsdp2"]
    wrap = None if fsdp2 else ray.train.torch.prepare_model
    while True:
        cmd = [inbox.get() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(cmd, src=0)
        if cmd[0] is None:
            return
        if cmd[0] == "ping":
            if dist.get_rank() == 0:
                outbox.put("ready")
            continue
        cfg = load_config(None, cmd[0]["overrides"])
        result = run_plain_point(cfg, config["data_path"], fsdp2, cmd[0]["warmup"], wrap=wrap)
        if dist.get_rank() == 0:
            outbox.put(result)


class RayTrainRun:
    """A `TorchTrainer` whose training function takes the points one by one from a queue."""

    def __init__(self, world: int, fsdp2: bool, data_path: str, storage: str):
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray.util.queue import Queue

        self.inbox, self.outbox = Queue(), Queue()
        trainer = TorchTrainer(
            _ray_train_loop,
            train_loop_config={"inbox": self.inbox, "outbox": self.outbox, "fsdp2": fsdp2, "data_path": data_path},
            scaling_config=ScalingConfig(num_workers=world, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage, name=f"ray-train-{'fsdp2' if fsdp2 else 'ddp'}"),
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fit, args=(trainer,), daemon=True)
        self.thread.start()

    def _fit(self, trainer) -> None:
        try:
            trainer.fit()
        except BaseException as e:  # reported by the next run()
            self.error = e

    def ready(self) -> None:
        self.inbox.put("ping")
        assert self._reply(600) == "ready"

    def run(self, point) -> dict:
        self.inbox.put({"overrides": _overrides(point), "warmup": point.warmup})
        return self._reply(3600)

    def _reply(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.error is not None:
                raise RuntimeError(f"Ray Train failed: {self.error}")
            try:
                return self.outbox.get(timeout=1)
            except Exception:
                continue
        raise TimeoutError("Ray Train point")

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(120)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
