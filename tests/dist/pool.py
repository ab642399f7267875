"""Rank processes kept for the whole pytest session: `spawn(fn, args, nprocs)` runs
`fn(rank, *args)` in `nprocs` of them, as `torch.multiprocessing.spawn` does in new ones.

A new process spends about 4 s of CPU importing torch, transformers and rayzero before it
runs a line of a test; the gloo tier starts ranks some 150 times. Here each of up to
`MAX_WORLD` processes is started once, on first use, and runs one job after another. Between
jobs a process is brought back to what a new one would be for a test: no process group, and
torch's global generator seeded (with one fixed seed, where a new process draws its own). A
job that fails on any rank (the others may be stuck in a collective waiting for it) ends every
process; the next job starts new ones.

A group's gloo threads (its TCP loops, which keep waking) go with it once nothing holds it
(`Rank.close` and `Rank.leave` collect what the strategy held); a job that leaves groups alive
without them still leaves their threads, and a process that has gathered `MAX_THREADS` of them
is replaced after its job. The pool is
closed once the tests leave the gloo tier (`tests/conftest.py`), so that idle rank processes
take no CPU from the tests after them.

A test may also run a job in a second `lane`, processes of their own, while it works on
something else (test_combinations.py runs the next configuration's ranks while it checks one).

Tests that measure the process itself through its memory limit keep spawning processes of
their own; those that count its live tensors count from a baseline taken in the job, which a
kept process serves as well as a new one."""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import traceback

import torch.multiprocessing as mp

MAX_WORLD = 4
MAX_THREADS = 100  # gloo's leftover threads in a rank process before it is replaced
TIMEOUT_S = 600.0  # one job, on every rank; pytest's own timeout is the same
_DEFAULT_SEED = 67280421310721  # every job's torch seed (a new process's own is drawn from entropy)


def _threads() -> int:
    """This process's threads, gloo's included (from /proc where there is one)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _serve(rank: int, jobs, results) -> None:
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    from rayzero.workers.membership import collect_and_freeze

    collect_and_freeze()  # as a rank actor's process does at its start
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, args = job
        torch.manual_seed(_DEFAULT_SEED)
        random.seed()
        np.random.seed()
        error = None
        try:
            fn(rank, *args)
        except BaseException:  # noqa: BLE001 (the test sees it, with the rank's traceback)
            error = traceback.format_exc()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, error, _threads()))


class RankPool:
    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.procs, self.jobs, self.results = [], [], None

    def _start(self, n: int) -> None:
        if self.results is None:
            self.results = self.ctx.Queue()
        while len(self.procs) < n:
            rank = len(self.procs)
            jobs = self.ctx.Queue()
            p = self.ctx.Process(target=_serve, args=(rank, jobs, self.results), daemon=True)
            p.start()
            self.procs.append(p)
            self.jobs.append(jobs)

    def spawn(self, fn, args: tuple = (), nprocs: int = 1) -> None:
        if not 1 <= nprocs <= MAX_WORLD:
            raise ValueError(f"nprocs={nprocs}: the pool has 1 to {MAX_WORLD} ranks")
        self._start(nprocs)
        for rank in range(nprocs):
            self.jobs[rank].put((fn, args))
        error, pending, threads = None, set(range(nprocs)), 0
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while pending and error is None:
                try:
                    rank, error, n = self.results.get(timeout=1.0)
                    pending.discard(rank)
                    threads = max(threads, n)
                    continue
                except queue.Empty:
                    pass
                dead = [r for r in sorted(pending) if not self.procs[r].is_alive()]
                if dead:
                    raise RuntimeError(f"rank process(es) {dead} died running {fn.__qualname__}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(pending)} did not finish {fn.__qualname__} in {TIMEOUT_S:g} s")
        except BaseException:
            self.close()
            raise
        if error is not None:  # the other ranks may wait on it forever: end them all
            self.close()
            raise RuntimeError(f"rank {rank} failed in {fn.__qualname__}:\n{error}")
        if threads > MAX_THREADS:  # new processes for the next job, without gloo's leftovers
            self.close()

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        self.procs, self.jobs, self.results = [], [], None


_pools: dict[str, RankPool] = {}  # lane -> its processes


def _lane(name: str) -> RankPool:
    if name not in _pools:
        _pools[name] = RankPool()
    return _pools[name]


def spawn(fn, args: tuple = (), nprocs: int = 1, lane: str = "main") -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` on the session's rank processes. A `lane`
    other than "main" is a set of processes of its own, for a job run beside the main lane's
    (one job at a time in each lane)."""
    _lane(lane).spawn(fn, args, nprocs)


def close() -> None:
    """End the session's rank processes, every lane's (the next `spawn` starts new ones)."""
    for pool in _pools.values():
        pool.close()


atexit.register(close)
