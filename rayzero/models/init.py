"""Initial values from (seed, names) alone: a model built with its parameters on the meta
device (`params_on_meta`), and `SeededInit`, which runs the model's own init functions module by
module, each seeded by its name (`name_seed`). The model kinds (hf.py, module.py) and the LoRA
adapters start from here."""

from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Iterator

import torch
import torch.nn as nn

from rayzero.models.errors import ModelError
from rayzero.sharding.flat_buffer import ParamSource


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real.

    Buffers (RoPE frequencies, masks) are computed by the module's own constructor, so every
    rank has them right; parameters take no memory until a strategy materializes them, one
    bucket (or ZeRO-3 unit) at a time. Parameters already on meta (a tied weight assigned
    again) are kept as they are, so ties survive."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def name_seed(seed: int, name: str) -> int:
    """A 32-bit seed from the run's seed and a name (torch's CPU generator keeps 32 bits)."""
    return zlib.crc32(f"{seed}/{name}".encode())


InitFn = Callable[[nn.Module], None]
InitFor = Callable[[str, nn.Module], "InitFn | None"]  # (module name, module) -> the init to run on it


class SeededInit(ParamSource):
    """Initial values of a model built on meta, module by module, seeded by name.

    A parameter belongs to the module that registers it. To initialize it, that module's
    parameters get real fp32 storage in a twin of the model (built on meta once), the global
    generator is seeded with (seed, module name), and the model's own init functions run on
    the module and then on each of its ancestors, innermost first: the order in which
    `nn.Module.apply` and transformers' `initialize_weights` run them, so an ancestor that
    rescales a child's weight (GPT-2's residual projections) does so here too. Whatever an init
    touches on another module is a meta tensor and a no-op. Each value is therefore a function
    of the seed and names alone: every rank, world size and strategy starts from the same
    weights, and any rank can initialize any part of the model.

    `init_fn(name, module)` gives the init to run on a module, or None. Parameters that no init
    writes are taken from `fallback()`, a whole model built on the CPU under the seed
    (built at most once, and only when needed)."""

    def __init__(self, twin: nn.Module, seed: int, init_fn: InitFor,
                 fallback: Callable[[], nn.Module] | None = None):
        self.twin, self.seed, self.init_fn, self._fallback = twin, seed, init_fn, fallback
        self.modules = dict(twin.named_modules())
        self.owner: dict[str, tuple[str, str]] = {}  # parameter name -> (module name, attribute)
        for mname, module in twin.named_modules():
            for attr, p in module.named_parameters(recurse=False):
                pname = f"{mname}.{attr}" if mname else attr
                self.owner.setdefault(pname, (mname, attr))
        self._ready: dict[str, torch.Tensor] = {}  # computed and not yet handed out
        self._cpu_model: nn.Module | None = None
        self.from_fallback: list[str] = []

    def fill(self, name: str, out: torch.Tensor) -> None:
        if name not in self._ready:
            self._init_module(self.owner[name][0])
        out.copy_(self._ready.pop(name))

    def _init_module(self, mname: str) -> None:
        module = self.modules[mname]
        direct = dict(module.named_parameters(recurse=False))
        real = {attr: torch.full(p.shape, float("nan")) for attr, p in direct.items()}
        chain = _ancestry(mname)  # the module first, then each ancestor
        try:
            for attr, t in real.items():
                module._parameters[attr] = nn.Parameter(t, requires_grad=False)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(name_seed(self.seed, mname))
                for m in chain:
                    fn = self.init_fn(m, self.modules[m])
                    if fn is not None:
                        fn(self.modules[m])
        finally:
            for attr, p in direct.items():
                module._parameters[attr] = p
        for attr, t in real.items():
            pname = f"{mname}.{attr}" if mname else attr
            if torch.isnan(t).any():  # no init wrote it: the constructor's own value
                t = self._fallback_value(pname)
            self._ready[pname] = t

    def _fallback_value(self, pname: str) -> torch.Tensor:
        if self._fallback is None:
            raise ModelError(f"no initialization writes parameter {pname}: give its module a reset_parameters()")
        if self._cpu_model is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                self._cpu_model = self._fallback()
        self.from_fallback.append(pname)
        return self._cpu_model.get_parameter(pname).detach().float().clone()


def _ancestry(mname: str) -> list[str]:
    """`a.b.c` -> [a.b.c, a.b, a, ""] (the module, then its ancestors up to the root)."""
    parts = mname.split(".") if mname else []
    return [".".join(parts[:k]) for k in range(len(parts), -1, -1)]
