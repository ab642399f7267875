"""A user's own `nn.Module` behind the model seam.

`model.factory` is `package.module:callable` (from Python, any callable: `Trainer(config,
model=callable)`), called with `model.kwargs`; it returns an `nn.Module` whose forward takes
token ids [B, T] and returns logits [B, T, V] (or an object with `.logits`). A forward that also
takes `position_ids` and `document_ids` keywords trains on packed rows (instruction data, text
with `data.document_masking`): each [B, T], a token's position in its example and the index in
its row where its example starts; its attention must keep each token to the keys of its own
example (from `document_ids` to itself). It is called with
parameters on the meta device; each module's `reset_parameters()` (torch's layers all have
one) initializes it, seeded by its name. ZeRO-3 units are the classes in
`sharding.fsdp_units`, or else the class of the largest `nn.ModuleList`'s layers.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from typing import Callable

import torch
import torch.nn as nn

from rayzero._imports import import_path
from rayzero.models.config import ModelConfig
from rayzero.models.init import SeededInit, params_on_meta
from rayzero.models.spec import (
    ModelError, ModelSpec, config_hash, weights_record,
)
from rayzero.sharding.flat_buffer import ParamSource

log = logging.getLogger(__name__)


def import_factory(path: str) -> Callable[..., nn.Module]:
    """`package.module:callable` imported; ModelError saying what failed."""
    try:
        obj = import_path(path, "model.factory", "package.module:callable")
    except ValueError as e:
        raise ModelError(str(e)) from None
    if not callable(obj):
        raise ModelError(f"model.factory: {path} is a {type(obj).__name__}, not a callable")
    return obj


def reset_fn(module: nn.Module):
    """The module's own initializer: `reset_parameters()` or `_reset_parameters()` (as
    nn.MultiheadAttention names it), or None."""
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(type(module), attr, None)
        if callable(fn):
            return fn
    return None


class ModuleSpec(ModelSpec):
    kind = "module"

    def __init__(self, cfg: ModelConfig, seed: int, factory: Callable[..., nn.Module] | None = None,
                 storage_cfg=None):
        super().__init__(cfg, seed, storage_cfg)
        self.factory = factory if factory is not None else import_factory(cfg.factory)
        self.kwargs = dict(cfg.kwargs)
        self._vocab: int | None = None

    @classmethod
    def create(cls, cfg: ModelConfig, *, seed: int, block_size: int, storage_cfg=None,
               factory: Callable[..., nn.Module] | None = None, record: dict | None = None) -> ModuleSpec:
        return cls(cfg, seed, factory, storage_cfg)

    @classmethod
    def takes_factory(cls) -> bool:
        return True

    @classmethod
    def exports_by_names(cls) -> bool:
        return True

    @classmethod
    def describe(cls, record: dict) -> str:
        return f"the module {record.get('factory')}" + (f" ({record['kwargs']})" if record.get("kwargs") else "")

    @property
    def where(self) -> str:
        return f"model.factory={self.cfg.factory}"

    def _call(self) -> nn.Module:
        try:
            model = self.factory(**self.kwargs)
        except Exception as e:
            raise ModelError(f"{self.where}: calling it with model.kwargs {self.kwargs} failed: "
                             f"{type(e).__name__}: {e}") from None
        if not isinstance(model, nn.Module):
            raise ModelError(f"{self.where}: returned a {type(model).__name__}, not an nn.Module")
        return model

    def _build(self) -> nn.Module:
        with params_on_meta():
            return self._call()

    def seeded(self, model: nn.Module) -> ParamSource:
        init = SeededInit(self._build(), self.seed, lambda _name, m: reset_fn(m), self._call)
        missing = [n for n, m in init.modules.items() if reset_fn(m) is None and any(True for _ in m.parameters(False))]
        if missing:
            log.warning("%s: module(s) %s have parameters but no reset_parameters(); their parameters come "
                        "from building the whole model on the CPU once, under train.seed", self.where,
                        ", ".join(missing[:5]))
        return init

    def fsdp_units(self, model: nn.Module) -> tuple[str, ...]:
        """The class of the layers in the model's largest `nn.ModuleList` (its blocks)."""
        return self._layers(model, "sharding.fsdp_units", "shard by")

    def blocks(self, model: nn.Module) -> tuple[str, ...]:
        return self._layers(model, "model.recompute_blocks", "recompute")

    def stage_blocks(self, model: nn.Module) -> list[str]:
        """A module's stages come from its own `pipeline_blocks()`: the names of its blocks in
        forward order, each taking the hidden states as its first argument and returning them
        (the modules with parameters before the first block go to the first stage, those after
        the last to the last one). Without it, a pipeline is refused."""
        hook = getattr(model, "pipeline_blocks", None)
        if hook is None:
            raise ModelError(f"parallel.pp: model.kind=module ({type(model).__name__}) does not say how it splits "
                             "into stages; give the module a `pipeline_blocks()` method returning its blocks' names "
                             "in forward order (each block takes and returns the hidden states), or set parallel.pp=1")
        names = list(hook())
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing or not names:
            raise ModelError(f"parallel.pp: {type(model).__name__}.pipeline_blocks() names "
                             f"{', '.join(missing) or 'no module'}, which the model does not have")
        return names

    def logits(self, model: nn.Module, batch):
        if batch.documents is None:
            return model(batch.tokens)
        return model(batch.tokens, position_ids=self.positions(batch), document_ids=batch.documents)

    def check_documents(self, model: nn.Module, why: str) -> None:
        if not forward_takes(model, "document_ids"):
            raise ModelError(f"{self.where}: {why} packs several examples into each row, and "
                             f"{type(model).__name__}.forward takes no `document_ids` to keep them apart; give it "
                             "`position_ids` and `document_ids` keywords ([batch, tokens]: each token's position in its "
                             "example, and where in the row its example starts) and keep each token's attention to the keys "
                             "from `document_ids` to itself")

    splits_sequence = True  # through the module's own hook, asked for when it is built

    def context_parallel(self, model: nn.Module, cp) -> None:
        """A module's attention is its own code, so the seam reaches it through the module's
        `context_parallel(attend, positions)` method, which must make every attention layer call
        `attend(q, k, v, dropout_p)` in place of its own ([batch, heads, local tokens, head dim]
        each, the key/value heads as the layer has them; causal over the tokens' global positions;
        returns [batch, heads, local tokens, head dim]), and take the positions of its `t` tokens
        from `positions(t, device)` (a rank holds two chunks of each sequence, not a run of it).
        Without it, a ModelError saying so."""
        hook = _hook(model, "context_parallel", "parallel.cp",
                     "does not say how its attention runs across a split sequence; give the module a "
                     "`context_parallel(attend, positions)` method that makes each attention layer call attend(q, k, v, "
                     "dropout_p) ([batch, heads, tokens, head dim]) and its position embedding take positions(t, device)")
        hook(cp.attend, cp.local_positions)

    def expert_parallel(self, model: nn.Module, ep) -> dict[str, tuple[int, ...]]:
        """A module's experts are its own code, reached through its `expert_parallel(ep)` method,
        which must keep, in each MoE layer, only this rank's experts `ep.experts(E)` (dim 0 of
        each expert tensor, in a module named `experts`), route the layer through `ep.run(hidden
        [N, H], top_k_index [N, k], top_k_weights [N, k], experts, E)` (`experts(x, counts)`:
        the local experts on `x`, its rows grouped by local expert, `counts[e]` rows for local
        expert e), and return each split tensor's whole shape by parameter name. Without it, a
        ModelError saying so."""
        hook = _hook(model, "expert_parallel", "parallel.ep",
                     "does not say how its experts split; give the module an `expert_parallel(ep)` method that keeps "
                     "each MoE layer's experts ep.experts(E) (dim 0 of its expert tensors, in a module named "
                     "`experts`), routes the layer through ep.run(hidden, top_k_index, top_k_weights, experts, E) and "
                     "returns the split tensors' whole shapes by name")
        return dict(hook(ep))

    def _layers(self, model: nn.Module, key: str, purpose: str) -> tuple[str, ...]:
        best = None
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m):
                size = sum(p.numel() for p in m.parameters())
                if best is None or size > best[0]:
                    best = (size, m)
        classes = {type(m).__name__ for m in best[1]} if best else set()
        if len(classes) != 1:
            names = sorted({type(m).__name__ for m in model.modules()})
            raise ModelError(f"{key}: {type(model).__name__} has no list of layers of one class to {purpose}; "
                             f"name its block class(es), e.g. {key}=Block (its module classes are "
                             f"{', '.join(names)})")
        return tuple(classes)

    @property
    def vocab_size(self) -> int | None:
        return self._vocab

    def probe(self, model: nn.Module, seq_len: int) -> None:
        """Run the forward on the meta device to learn the output's shape without computing:
        a ModelError for output that is not [B, T, V]. Models whose forward cannot run on meta
        are checked on the first micro-batch instead."""
        x = torch.zeros(2, min(seq_len, 8), dtype=torch.long, device="meta")
        try:
            with torch.no_grad():
                out = model(x)
        except Exception:
            return
        from rayzero.models.spec import check_logits

        self._vocab = check_logits(out, x, self.where).shape[-1]

    def check(self, seq_len: int, data_vocab: int | None = None) -> None:
        model = self.build()
        self.probe(model, seq_len)
        if self._vocab is not None:
            super().check(seq_len, data_vocab)
        if self.weights is not None:
            self.resolve(model)

    def record(self) -> dict:
        try:
            code = hashlib.sha256(inspect.getsource(self.factory).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            code = None
        desc = {"factory": self.cfg.factory, "kwargs": self.kwargs}
        return {"kind": self.kind, **desc, "config_sha256": config_hash(desc), "factory_source_sha256": code,
                "seed": self.seed, **weights_record(self.weights, self.cfg.path), **self.adapter_record()}


def forward_takes(model: nn.Module, name: str) -> bool:
    """Whether the module's forward takes the keyword argument `name`."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _hook(model: nn.Module, name: str, key: str, missing: str):
    """The module's own method `name`, through which the seam reaches what `key` splits; a
    ModelError saying what it must do where the module has none."""
    hook = getattr(model, name, None)
    if not callable(hook):
        raise ModelError(f"{key}: model.kind=module ({type(model).__name__}) {missing}, or set {key}=1")
    return hook


def describe(factory: Callable) -> str:
    """A callable's `module:qualname`, as model.factory names it."""
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"


