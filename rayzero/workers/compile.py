"""`train.compile`: each transformer block's `forward` compiled with `torch.compile`.

What is compiled, and what is not:
- The block's own `forward`, replaced on the instance (as activation checkpointing replaces
  it): names stay the model's own, and the module hooks a strategy registers (ZeRO-3's unit
  gathers and releases, gradient hooks on its parameters) run outside the compiled code, as
  torchtitan compiles blocks under FSDP2. The embedding, the head and the loss stay eager.
- Compiled before activation checkpointing wraps the block: a recompute calls the compiled
  forward again, with the dropout streams put back as for an eager block. `selective`
  recomputation, which picks ops inside the block by name, is refused with compilation (the
  compiled block runs as one op to it).
- Dropout inside a compiled block draws from torch's own generators as eager code does
  (inductor's `fallback_random`): the same masks from the same stream state, so a resume, a
  recompute and every world size draw what an eager run draws.
- Inductor's caches (FX graphs, AOT autograd, kernels) are kept on disk in the run's directory
  (`train.compile_cache`, set as `TORCHINDUCTOR_CACHE_DIR` before the first compile): a
  restart, a spare or the resumed run loads them instead of compiling again. Dynamo's tracing
  is not cached: each new process traces its blocks again (a second or less a block class).

The hooks on modules inside a compiled block keep Python state that changes from call to call;
traced, they would make dynamo recompile the block each time (until its limit, then run it
eagerly). ZeRO-1/2's waits for a bucket's all-gather move to the block's entry (the block is
marked `compiled_block`, `sharding/ownership.py`); the others (tensor parallelism's input
copies and dropout stream regions) stay where they are, and `hooks_stay_eager` has dynamo call
them without tracing them: the block is compiled in the pieces between them, once.

`compile_seconds()` is what this process has spent compiling so far (tracing, AOT autograd
and the backend, forward and backward), which a rank reports per iteration (`phase_s`'s
`torch_compile`).
"""

from __future__ import annotations

import functools

import torch.nn as nn


def compile_blocks(model: nn.Module, blocks: list[str], backend: str, cache: str | None = None) -> None:
    """Compile the named blocks' `forward` with `backend`, inductor's caches in `cache` (see the
    module doc)."""
    import torch

    if backend == "inductor":
        import torch._inductor.config as inductor

        inductor.fallback_random = True
        use_cache_dir(cache)
    modules = dict(model.named_modules())
    for name in blocks:
        module = modules[name]
        compiled = torch.compile(module.forward, backend=backend, dynamic=False)
        module.forward = functools.wraps(module.forward)(compiled)
        module.compiled_block = True  # read by the strategies: a wait for a bucket goes at its entry


def use_cache_dir(cache: str | None) -> str:
    """Point inductor's on-disk caches at `cache` (None: leave them where they are) and return
    where they are. A directory this process cannot create (another node's path) leaves them
    where they were. The caches inductor memoizes the directory in are cleared when it changes:
    a kept process may serve runs with different directories. Kernels cut short by a process
    killed while it wrote them are deleted (`broken_kernels`), before anything is compiled."""
    import os
    import sys

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if cache and os.environ.get("TORCHINDUCTOR_CACHE_DIR") != os.path.abspath(cache):
        try:
            os.makedirs(cache, exist_ok=True)
        except OSError:
            return cache_dir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache)
        from torch._inductor.utils import clear_caches

        clear_caches()
    where = cache_dir()
    for path in broken_kernels(where):
        print(f"rayzero: deleted {path} from inductor's cache: it was cut short (a process killed while it was "
              "written); it is compiled again", file=sys.stderr, flush=True)
    return where


def hooks_stay_eager(model: nn.Module, blocks: list[str]) -> int:
    """Every forward hook and pre-hook of a module inside the named (compiled) blocks, the
    blocks' own excepted (they run outside the compiled forward), wrapped so that dynamo runs it
    as it is instead of tracing it. Returns how many were wrapped."""
    import torch

    modules, wrapped = dict(model.named_modules()), 0
    for name in blocks:
        if name not in modules:  # another pipeline stage's block
            continue
        for inner in modules[name].modules():
            if inner is modules[name]:
                continue
            for hooks in (inner._forward_pre_hooks, inner._forward_hooks):
                for key, hook in list(hooks.items()):
                    if not getattr(hook, "_rayzero_eager", False):
                        eager = torch.compiler.disable(hook)
                        eager._rayzero_eager = True
                        hooks[key] = eager
                        wrapped += 1
    return wrapped


class Compiling:
    """Which of a rank's iterations compile with `train.compile`, and what they spent (a rank
    without it holds none): the first after `setup` (training's graphs, forward and backward)
    and the first that evaluates (the graphs of the model in eval mode). The watchdog gives an iteration that
    compiles the grace of a rank still starting (`progress()`'s `compiling`): a cold compile
    takes longer than a step, and a rank killed in it may leave its half-written kernels
    behind (`broken_kernels`)."""

    def __init__(self):
        self.now = False
        self.trained = self.evaluated = False
        self._began_s = 0.0  # compile_seconds() as the iteration began

    def begin(self, plan: dict) -> None:
        """An iteration of `plan` begins."""
        evaluates = bool(plan.get("evaluate") or plan.get("evaluate_first"))
        self.now = not self.trained or (evaluates and not self.evaluated)
        self._began_s = compile_seconds()

    def end(self, plan: dict) -> float:
        """The iteration ends: the seconds it spent compiling."""
        self.trained, self.now = True, False
        self.evaluated |= bool(plan.get("evaluate") or plan.get("evaluate_first"))
        return compile_seconds() - self._began_s


def broken_kernels(cache: str) -> list[str]:
    """The compiled kernels in inductor's cache `cache` that are cut short, each deleted: inductor's
    C++ compiler writes a kernel's library (and its objects) in place, so a rank killed while it
    wrote one (a lost node, a hang torn down in a cold compile) leaves a truncated file that every
    later process loads as it is, restart after restart: a crash (SIGBUS) or "file too short". A
    file is checked again under the kernel's own lock (the one inductor holds while it builds it),
    so a kernel another process is building is waited for, not deleted. Returns the paths deleted."""
    import glob
    import os

    from filelock import FileLock, Timeout  # what inductor locks a kernel with (torch.utils._filelock)

    dropped = []
    for path in sorted(glob.glob(os.path.join(cache, "*", "*.[os]*"))):
        if not path.endswith((".so", ".o")) or not _cut_short(path):
            continue
        key = os.path.basename(path).split(".")[0]  # c<hash>: the kernel's lock is locks/<key>.lock
        try:
            with FileLock(os.path.join(cache, "locks", key + ".lock"), timeout=60):
                if _cut_short(path):
                    os.remove(path)
                    dropped.append(path)
        except (Timeout, OSError):
            continue  # still being built after a minute, or gone: not this process's to delete
    return dropped


def _cut_short(path: str) -> bool:
    """Whether the ELF file at `path` ends before what its header says it holds (its program
    and section header tables, its loaded segments), or before a header. Another format (a
    Mach-O library on macOS) is taken as whole."""
    import os
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64:
                return True
            if head[:4] != b"\x7fELF" or head[4] != 2:  # not ELF64
                return False
            order = "<" if head[5] == 1 else ">"
            phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
            if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
                return True
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError:
        return False  # gone meanwhile
    for k in range(phnum):  # Elf64_Phdr: p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz
        _, _, offset, _, _, filesz = struct.unpack_from(order + "IIQQQQ", table, k * phentsize)
        if offset + filesz > size:
            return True
    return False


def forget_compiled() -> None:
    """Drop what dynamo compiled in this process (its code caches, which hold the compiled
    modules, and their recompile counts) when a rank drops its model: a surviving rank leaving
    its group for a new rendezvous, or a run's end in a kept process. Inductor's on-disk caches
    stay: the next setup loads from them instead of compiling again."""
    import torch

    torch._dynamo.reset()


def compile_seconds() -> float:
    """Seconds this process has spent in `torch.compile` so far: dynamo's frames (which take in
    AOT autograd and the backend's forward) and the backward graphs compiled at the first
    backward. 0 before anything is compiled (torch._dynamo not even imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    metrics = getattr(utils, "compilation_time_metrics", {})
    return float(sum(metrics.get("_compile.compile_inner", ())) + sum(metrics.get("backward._backward_impl", ())))
