"""The Ray actor hosting one rank: a thin shim that forwards every call to `Rank`."""

from __future__ import annotations

import os
import threading

import ray
import torch

from rayzero.config import RootConfig
from rayzero.workers.membership import collect_and_freeze
from rayzero.workers.phases import CALLS
from rayzero.workers.rank import Rank


class RankShim:
    """Forwards every call to a `Rank`; `RankActor` is this as a Ray actor. The calls of
    `phases.CALLS` (setup, checkpoints, the iteration's phases) are added below, one each."""

    def __init__(self, cfg: RootConfig, rank: int | None, world_size: int, data_path: str, factory=None):
        """`rank`: None for a warm spare (see `Rank`)."""
        collect_and_freeze()  # the process has just started: what it holds now is its imports
        self.rank = Rank(cfg, rank, world_size, data_path, factory)

    # In its own thread, so the controller's watchdog gets an answer while a phase runs.
    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        return self.rank.progress()

    # In a thread of its own, and never returning: a call the driver waits on (`ray.wait`,
    # which does not spin) until this process ends, when it fails at once. The compiled graph's
    # driver naps through an iteration on these calls (cluster/dispatch.py), so that a lost rank
    # wakes it within milliseconds instead of at the nap's end (on average half a step later).
    @ray.method(concurrency_group="exit")
    def until_exit(self) -> None:
        threading.Event().wait()

    def address(self) -> tuple[str, int]:
        return self.rank.address(ray.util.get_node_ip_address())

    def close(self) -> None:
        self.rank.close()

    def renew(self, cfg: RootConfig, rank: int | None, world_size: int, data_path: str, factory=None) -> dict:
        """A kept process (`cluster.keep_ranks`) becomes a new run's rank: its closed `Rank` goes,
        a new one is made as `__init__` makes it, and torch's global generator is seeded from the
        system's entropy as a new process's is (nothing of the run before decides a draw); torch
        and the model's code stay imported."""
        self.rank = Rank(cfg, rank, world_size, data_path, factory)
        collect_and_freeze()  # the closed rank's leftovers go; what lives on is not scanned again
        torch.seed()
        return {"pid": os.getpid()}

    # A spare's and a survivor's calls, outside `phases.CALLS`: none of them is a step of the
    # run that the watchdog times or the history records. A spare has no watchdog (it is in no
    # group), and the controller bounds `disconnect` and `leave` with its own timeout, after
    # which it falls back to a full restart; `assign` is arithmetic. They run on the actor's
    # default thread, free while the compiled graph's thread may be stuck in a collective.
    def warm(self) -> dict:
        return self.rank.warm()

    def assign(self, rank: int, world_size: int) -> dict:
        return self.rank.assign(rank, world_size)

    def disconnect(self) -> dict:
        return self.rank.disconnect()

    def leave(self, upload_wait_s: float = 10.0) -> dict:
        return self.rank.leave(upload_wait_s)


def _forwarded(name: str):
    def call(self, *args):
        return getattr(self.rank, name)(*args)

    call.__name__, call.__qualname__ = name, f"RankShim.{name}"
    call.__doc__ = f"`Rank.{name}` on this actor's rank."
    return call


for _name in CALLS:
    setattr(RankShim, _name, _forwarded(_name))


def rank_actor(cls: type = RankShim):
    """`cls` (RankShim or a subclass) as a Ray actor class with the watchdog's thread and the
    thread that waits for the process's end (`until_exit`)."""
    return ray.remote(concurrency_groups={"control": 1, "exit": 1})(cls)


RankActor = rank_actor()
