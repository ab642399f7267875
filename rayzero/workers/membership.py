"""A rank's place in its group, apart from training: a warm spare loading the model's code and
given a lost rank's coordinates, a survivor cutting its broken group's connections and leaving it
while its process stays. Mixed into `Rank` (rank.py), which owns what these release (`_drop`)."""

from __future__ import annotations

import gc
import os
import time

import torch.distributed as dist

from rayzero.workers.assembly import build_model, make_spec
from rayzero.workers.compile import forget_compiled
from rayzero.workers.disconnect import break_group


def collect_and_freeze() -> None:
    """A full collection, then what is alive leaves the cyclic collector's view (`gc.freeze`).
    In a rank process after its imports (torch, Ray, rayzero), and again whenever a run has
    released what it built (`leave`, a kept rank's `renew`, a spare's `warm`): by then the
    process also holds what the run imported and cached (an HF model's code, PEFT, torch's
    distributed modules: 3,500 objects for the built-in GPT, ~215,000 in the tests' rank
    processes), and without this every later full collection (each `leave`, and Python's own of
    the oldest generation while training) scanned them again: 0.35 s each in the tests' rank
    processes on this machine, ~0 after. Objects alive now are still freed when their last reference
    goes; only a reference cycle among them is never collected, so this runs when the run's own
    objects (model, strategy, data) are gone. (`gc.get_objects()`, which `live_tensor_bytes`
    reads, no longer sees them: its counts are differences within a run.)"""
    gc.collect()
    gc.freeze()


def warm_compiler(backend: str) -> None:
    """Import what `train.compile` compiles with (dynamo; inductor's compiler and caches), which
    a spare otherwise imports in its `setup` while the group waits for it: 0.9 s and 0.7 s alone
    in a fresh process on this machine."""
    import torch._dynamo  # noqa: F401

    if backend == "inductor":
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401


class Membership:
    """`Rank`'s spare and survivor calls (see `Rank`'s doc): they use its `cfg`, `factory`,
    `mesh`, `_group_sockets` and `_drop`."""

    def warm(self) -> dict:
        """On a spare, before it has a rank: load the model's code by building the model once
        on the meta device (no memory, no process group), and with `train.compile` the
        compiler's (`warm_compiler`), so that `setup` after `assign` pays for none of it. The
        built model is dropped: the rank builds its own, for its mesh; what the build imported
        leaves the collector's view (`collect_and_freeze`), so that its `leave` after a failure
        does not scan it."""
        t0 = time.perf_counter()
        build_model(self.cfg, make_spec(self.cfg, self.factory))
        if self.cfg.train.compile:
            warm_compiler(self.cfg.train.compile_backend)
        collect_and_freeze()
        return {"pid": os.getpid(), "warm_s": time.perf_counter() - t0}

    def assign(self, rank: int, world_size: int) -> dict:
        """Give this spare (or a rank that has left its group) the mesh coordinates of `rank`
        of `world_size`; `setup` joins the group there."""
        if dist.is_initialized():
            raise RuntimeError(f"assign({rank}, {world_size}) on a rank still in a process group: leave first")
        self.mesh = self.cfg.mesh(world_size, rank)
        return {"rank": rank, "pid": os.getpid()}

    def disconnect(self) -> dict:
        """A peer is lost: make every collective of this rank's process groups in flight, here
        or at a peer waiting on this rank, fail now rather than at the collective timeout
        (`workers/disconnect.py`). Safe from another thread while a phase is stuck in one;
        `leave` then destroys the groups."""
        return {"rank": self.mesh.rank if self.mesh is not None else None,
                "cut": break_group(getattr(self, "_group_sockets", set()))}

    def leave(self, upload_wait_s: float = 10.0) -> dict:
        """Leave a process group that lost a member, keeping the process (torch imported, the
        model's code loaded) for a `setup` at a new rendezvous. No barrier: a peer is dead.
        Drops the model, strategy, data readers and saver. A checkpoint upload in flight gets
        `upload_wait_s` to finish (a later step may write the same file); past that this
        raises, and the process must go (the upload thread cannot be stopped from outside).
        Returns the uploads finished and not yet reported, which may still complete a commit."""
        t0 = time.perf_counter()
        rank = self.mesh.rank if self.mesh is not None else None
        uploads = self._drop(upload_wait_s)
        if self.cfg.train.compile:  # what dynamo compiled holds the dropped model; the next setup compiles its own
            forget_compiled()
        if dist.is_initialized():
            # No barrier and nothing sent: with a SIGKILLed peer this takes ~0.2 s on gloo
            # (benchmarks/recovery.py: the "leave" part), most of it the collection below.
            dist.destroy_process_group()
        if self.mesh is not None:
            self.mesh = self.cfg.mesh(self.mesh.world_size, self.mesh.rank)  # its groups are gone
        # The buffers go now, before the next setup's: after the group, whose work may hold them;
        # what survives (the process's imports, the run's among them) is not scanned again
        collect_and_freeze()
        return {"rank": rank, "uploads": uploads, "leave_s": time.perf_counter() - t0}
