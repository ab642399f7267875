"""The Ray actor hosting one rank: a thin shim that forwards every call to `Rank`.

This module imports neither torch nor the rank's code (its process does, as it starts): the
driver names `RankActor` to place ranks while its own imports go on (`place_ahead`)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import ray

from rayzero.workers.phases import CALLS

if TYPE_CHECKING:
    from rayzero.config import RootConfig


class RankShim:
    """Forwards every call to a `Rank`; `RankActor` is this as a Ray actor. The calls of
    `phases.CALLS` (setup, checkpoints, the iteration's phases) are added below, one each."""

    def __init__(self, cfg: RootConfig | None, rank: int | None, world_size: int, data_path: str, factory=None,
                 objective=None):
        """`rank`: None for a warm spare (see `Rank`); `cfg`: None for a process started ahead of
        its run (`place_ahead`), which imports what a rank needs and waits for `renew`."""
        from rayzero.workers.membership import collect_and_freeze
        from rayzero.workers.rank import Rank  # torch and the model code: the process's start

        collect_and_freeze()  # the process has just started: what it holds now is its imports
        self.rank = Rank(cfg, rank, world_size, data_path, factory, objective) if cfg is not None else None

    # In its own thread, so the controller's watchdog gets an answer while a phase runs.
    @ray.method(concurrency_group="control")
    def progress(self) -> dict:
        return self.rank.progress() if self.rank is not None else {"phase": None, "ahead": True}

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
        if self.rank is not None:  # (a process started ahead has no rank until `renew`)
            self.rank.close()

    def renew(self, cfg: RootConfig, rank: int | None, world_size: int, data_path: str, factory=None,
              objective=None) -> dict:
        """A kept process (`cluster.keep_ranks`, or one started ahead of its run) becomes a new
        run's rank: its closed `Rank` goes (if any), a new one is made as `__init__` makes it, and
        torch's global generator is seeded from the system's entropy as a new process's is
        (nothing of the run before decides a draw); torch and the model's code stay imported."""
        import torch

        from rayzero.workers.membership import collect_and_freeze
        from rayzero.workers.rank import Rank

        self.rank = Rank(cfg, rank, world_size, data_path, factory, objective)
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

    def send_weights(self, version: int, trainable_only: bool) -> list:
        """The whole weights for the rollout actors, bucket by bucket, each put in Ray's object
        store as soon as it is gathered (and dropped here): the buckets' refs on the ranks that
        send (`Rank.weight_buckets`), [] on the others. `version`: the weights' version, for
        the log."""
        out = []
        for part in self.rank.weight_buckets(trainable_only):
            if part is not None:
                out.append((ray.put(part), sum(t.numel() * t.element_size() for t in part.values())))
        return out

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
