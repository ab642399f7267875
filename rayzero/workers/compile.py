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
- Inductor's caches (FX graphs, AOT autograd, kernels) are on by default and kept on disk
  (`TORCHINDUCTOR_CACHE_DIR`, else a directory per user in the system's temp directory): a
  restart, a spare or the next run of the same blocks loads them instead of compiling again.

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


def compile_blocks(model: nn.Module, blocks: list[str], backend: str) -> None:
    """Compile the named blocks' `forward` with `backend` (see the module doc)."""
    import torch

    if backend == "inductor":
        import torch._inductor.config as inductor

        inductor.fallback_random = True
    modules = dict(model.named_modules())
    for name in blocks:
        module = modules[name]
        compiled = torch.compile(module.forward, backend=backend, dynamic=False)
        module.forward = functools.wraps(module.forward)(compiled)
        module.compiled_block = True  # read by the strategies: a wait for a bucket goes at its entry


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
