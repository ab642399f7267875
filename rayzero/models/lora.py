"""LoRA adapters through PEFT, on a model built on the meta device, before it is sharded.

    added, adapters = add_lora(model, settings)       # PEFT's LoRA layers injected, the base frozen
    source = AdapterInit(model, seed, adapters)       # the adapters' initial values, by name
    read = merged_reader(read, shape_of, adapters)    # exports: base weights with the adapters merged
    keys = peft_keys(adapters, saved)                 # exports: the adapter alone, as PEFT writes it

PEFT wraps each adapted linear layer (`q_proj`) in a layer of its own that keeps the original
as `q_proj.base_layer`. The names checkpoints, exports and pretrained weights see stay the
model's own: the wrapper registers the base layer's parameters under their old names too
(`q_proj.weight`: `named_parameters()` lists a parameter once, under the name it meets first)
and its `state_dict()` leaves out the `base_layer.` copies. The adapters are
`q_proj.lora_A.default.weight` and `q_proj.lora_B.default.weight`.

The base weights are frozen (no gradient, no main copy, no optimizer state: the strategies keep
frozen parameters in the compute dtype only), `modules_to_save` train whole, and the adapters
start from PEFT's own init seeded by the module's name (lora_B zero), so every world size and
strategy trains the same adapters.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from rayzero.models.errors import ModelError, ModelUnavailable
from rayzero.sharding.flat_buffer import ParamSource

ADAPTER = "default"  # PEFT's name for the one adapter a model has
PEFT_PREFIX = "base_model.model."  # the prefix PEFT's adapter files give every key


@dataclass(frozen=True)
class Adapter:
    """One adapted linear layer: its base weight, its two adapter matrices (by parameter
    name), and how they merge: W + scaling * (B @ A), transposed for a layer that keeps its
    weight as (in, out) (GPT-2's Conv1D)."""

    module: str
    base: str
    a: str
    b: str
    scaling: float
    fan_in_fan_out: bool

    def delta(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d = (b.float() @ a.float()) * self.scaling
        return d.T if self.fan_in_fan_out else d


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return nn.Linear, Conv1D


def _matches(name: str, entry: str) -> bool:
    """PEFT's rule for a `target_modules` entry: the module's whole name, or its last parts."""
    return name == entry or name.endswith("." + entry)


def linear_layers(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what `target_modules` takes)."""
    names = [n for n, m in model.named_modules() if isinstance(m, _linear_types())]
    return sorted({n.rpartition(".")[2] for n in names})


def _tied(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for key, v in model.state_dict(keep_vars=True).items():
        names.setdefault(id(v), []).append(key)
    return names


def targets(model: nn.Module, settings) -> list[str]:
    """The modules `settings.target_modules` names (PEFT's default for the architecture when
    empty). ModelError for an entry that matches nothing, a module that is not a linear layer,
    or one whose weight is tied to another (a GPT's head shares the embedding)."""
    modules = dict(model.named_modules())
    entries = list(settings.target_modules)
    candidates = ", ".join(linear_layers(model)) or "none"
    if not entries:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        kind = getattr(getattr(model, "config", None), "model_type", None)
        if kind not in DEFAULTS:
            raise ModelError(f"model.lora.target_modules: PEFT has no default for {type(model).__name__}"
                             f"{f' (model_type {kind!r})' if kind else ''}; name the layers to adapt, e.g. "
                             f"model.lora.target_modules=... from its linear layers: {candidates}")
        entries = list(DEFAULTS[kind])
    tied = _tied(model)
    chosen: list[str] = []
    for entry in entries:
        found = [n for n in modules if n and _matches(n, entry)]
        if not found:
            raise ModelError(f"model.lora.target_modules: {entry} matches no module; the linear layers are "
                             f"{candidates}")
        for n in found:
            m = modules[n]
            if not isinstance(m, _linear_types()):
                raise ModelError(f"model.lora.target_modules: {entry} matches {n} ({type(m).__name__}); LoRA "
                                 f"here adapts linear layers: {candidates}")
            also = [k for k in tied.get(id(m.weight), []) if k != f"{n}.weight"]
            if also:
                raise ModelError(f"model.lora.target_modules: {n}.weight is tied to {also[0]}, so merging an "
                                 f"adapter into it would change both; adapt other layers")
        chosen += [n for n in found if n not in chosen]
    return chosen


def saved_modules(model: nn.Module, settings) -> list[str]:
    """The modules `settings.modules_to_save` names: trained whole beside the adapters.
    ModelError for an entry that matches nothing."""
    modules = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    out: list[str] = []
    for entry in settings.modules_to_save:
        found = [n for n in modules if _matches(n, entry)]
        if not found:
            leaves = sorted({n.rpartition(".")[2] for n in modules})
            raise ModelError(f"model.lora.modules_to_save: {entry} matches no module with parameters; they are "
                             f"{', '.join(leaves)}")
        out += [n for n in found if n not in out]
    return out


def peft_config(settings, target_modules: list[str], base: str = ""):
    """PEFT's `LoraConfig` for these settings, the targets given by their full names."""
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=target_modules, modules_to_save=list(settings.modules_to_save) or None,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base or None)


def add_lora(model: nn.Module, settings) -> tuple[frozenset[str], dict[str, Adapter]]:
    """Inject PEFT's LoRA layers into `model` (on the meta device), in place: every other
    parameter frozen but those of `modules_to_save`, the model's own names kept. Returns (the
    adapters' parameter names, the adapters by base weight name)."""
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    chosen = targets(model, settings)
    keep = saved_modules(model, settings)
    config = peft_config(settings, chosen)
    config.modules_to_save = None  # trained in place here, not as PEFT's copies
    before = {n for n, _ in model.named_parameters()}
    inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    for m in model.modules():
        if isinstance(m, LoraLayer):
            _keep_names(m)
    adapters = adapters_of(model)
    names = {n for n, _ in model.named_parameters()}
    if names - {n for a in adapters.values() for n in (a.a, a.b)} != before:
        raise ModelError("model.lora: PEFT's layers changed the model's own parameter names "
                         f"({sorted((names - before))[:3]}): this layer type is not supported")
    for n, p in model.named_parameters():
        if any(n.startswith(k + ".") for k in keep):
            p.requires_grad_(True)
    return frozenset(n for a in adapters.values() for n in (a.a, a.b)), adapters


def _keep_names(layer: nn.Module) -> None:
    """The base layer's parameters under the wrapper's name too (`q_proj.weight`); its
    state_dict without their `base_layer.` copies, and `load_state_dict` taking them by the
    model's own names."""
    own = [a for a, p in layer.get_base_layer()._parameters.items() if p is not None]

    def alias(*_):
        base = layer.get_base_layer()  # looked up each time: tensor parallelism may replace it
        for attr in own:
            layer._parameters[attr] = base._parameters[attr]  # `weight` is a property of PEFT's layer: no setattr

    def drop_copies(_module, state, prefix, _meta):
        for attr in own:
            state.pop(f"{prefix}base_layer.{attr}", None)

    def load_copies(_module, state, prefix, *_):
        for attr in own:
            if f"{prefix}{attr}" in state:
                state.setdefault(f"{prefix}base_layer.{attr}", state[f"{prefix}{attr}"])

    alias()
    layer.register_state_dict_post_hook(drop_copies)
    layer._register_load_state_dict_pre_hook(load_copies, with_module=True)
    layer.register_load_state_dict_post_hook(alias)


def adapters_of(model: nn.Module) -> dict[str, Adapter]:
    """The adapters of a model `add_lora` changed, by base weight name."""
    from peft.tuners.lora import LoraLayer

    return {f"{n}.weight": Adapter(n, f"{n}.weight", f"{n}.lora_A.{ADAPTER}.weight", f"{n}.lora_B.{ADAPTER}.weight",
                                   float(m.scaling[ADAPTER]), bool(getattr(m, "fan_in_fan_out", False)))
            for n, m in model.named_modules() if isinstance(m, LoraLayer)}


class AdapterInit(ParamSource):
    """The adapters' initial values: PEFT's own `reset_lora_parameters` on real tensors, under
    the global generator seeded by (seed, the layer's name), so a value depends on the seed
    and names alone (lora_A as PEFT draws it, lora_B zero), whole (a tensor-parallel rank takes
    its slice through `TPSlices`)."""

    def __init__(self, model: nn.Module, seed: int, adapters: dict[str, Adapter],
                 shapes: dict[str, tuple[int, ...]] | None = None):
        """`shapes`: the whole shapes of adapters the model holds a tensor-parallel slice of."""
        self.model, self.seed, self.shapes = model, seed, shapes or {}
        self.owner = {n: a for a in adapters.values() for n in (a.a, a.b)}
        self._ready: dict[str, torch.Tensor] = {}

    def fill(self, name: str, out: torch.Tensor) -> None:
        if name not in self._ready:
            self._init(self.owner[name])
        out.copy_(self._ready.pop(name))

    def _init(self, a: Adapter) -> None:
        from rayzero.models.init import name_seed

        layer = self.model.get_submodule(a.module)
        mods = {a.a: layer.lora_A[ADAPTER], a.b: layer.lora_B[ADAPTER]}
        kept = {n: m._parameters["weight"] for n, m in mods.items()}
        real = {n: torch.zeros(self.shapes.get(n, p.shape)) for n, p in kept.items()}
        try:
            for n, m in mods.items():
                m._parameters["weight"] = nn.Parameter(real[n], requires_grad=False)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(name_seed(self.seed, a.module))
                layer.reset_lora_parameters(ADAPTER, True)
        finally:
            for n, m in mods.items():
                m._parameters["weight"] = kept[n]
        self._ready.update(real)


def merged_reader(read: Callable[[str, int, int], torch.Tensor], shape_of: Callable[[str], tuple],
                  adapters: dict[str, Adapter]) -> Callable[[str, int, int], torch.Tensor]:
    """`read(param, lo, hi)` (flat fp32 elements of a parameter) with each adapted base weight
    read as W + scaling * (B @ A), merged in fp32 (the last one kept for its next slice)."""
    last: dict[str, torch.Tensor] = {}

    def numel(name):
        return math.prod(shape_of(name))

    def merged(name: str, lo: int, hi: int) -> torch.Tensor:
        a = adapters.get(name)
        if a is None:
            return read(name, lo, hi)
        if name not in last:
            last.clear()
            w = read(name, 0, numel(name)).float().view(shape_of(name))
            da = read(a.a, 0, numel(a.a)).view(shape_of(a.a))
            db = read(a.b, 0, numel(a.b)).view(shape_of(a.b))
            last[name] = (w + a.delta(da, db)).reshape(-1)
        return last[name][lo:hi]

    return merged


def merge_weights(weights: dict[str, torch.Tensor], adapters: dict[str, Adapter]) -> dict[str, torch.Tensor]:
    """A whole state dict with the adapters merged into their base weights and left out."""
    out = {k: v for k, v in weights.items() if not any(k in (a.a, a.b) for a in adapters.values())}
    for name, a in adapters.items():
        out[name] = (weights[name].float() + a.delta(weights[a.a], weights[a.b])).to(weights[name].dtype)
    return out


def peft_keys(adapters: dict[str, Adapter], saved: list[str]) -> dict[str, str]:
    """The keys of PEFT's adapter file (`adapter_model.safetensors`), each to the parameter it
    holds: `base_model.model.<layer>.lora_A.weight` (the adapter's name left out, as
    `get_peft_model_state_dict` writes them), and a saved module's parameters under
    `base_model.model.<name>`."""
    out = {}
    for a in adapters.values():
        out[f"{PEFT_PREFIX}{a.module}.lora_A.weight"] = a.a
        out[f"{PEFT_PREFIX}{a.module}.lora_B.weight"] = a.b
    for n in saved:
        out[PEFT_PREFIX + n] = n
    return out


def adapter_config(settings, adapters: dict[str, Adapter], base: str) -> bytes:
    """`adapter_config.json`, as PEFT writes it, for `PeftModel.from_pretrained` onto `base`."""
    config = peft_config(settings, sorted({a.module for a in adapters.values()}), base).to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    return json.dumps(config, indent=2, sort_keys=True).encode()


def lora_of(spec, settings) -> tuple[dict[str, Adapter], list[str]]:
    """(the adapters by base weight name, the parameters of `modules_to_save`) of the model
    `spec` builds with `settings`: what an export needs to know (built on the meta device)."""
    model = spec.build()
    added, adapters = add_lora(model, settings)
    return adapters, [n for n, p in model.named_parameters() if p.requires_grad and n not in added]


# -- starting from an adapter directory (`model.adapter`) -------------------------------------

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT options that change what an adapter computes, which rayzero's LoRA does not train.
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
                "layers_to_transform": None, "bias": "none", "use_qalora": False, "lora_bias": False}


@dataclass(frozen=True)
class AdapterDir:
    """A PEFT adapter directory: its `adapter_config.json`, the base model it names
    (`base_model_name_or_path`) and, for one rayzero wrote, the model it was trained on (the
    `export_identity` in its weights' metadata; {} for others)."""

    uri: str
    config: dict
    identity: dict

    @property
    def base(self) -> str:
        return self.config.get("base_model_name_or_path") or ""

    def settings(self) -> dict:
        """Its LoRA settings, as `model.lora` takes them."""
        c = self.config
        targets = c.get("target_modules") or ()
        return {"r": c.get("r", 8), "alpha": c.get("lora_alpha", 8), "dropout": c.get("lora_dropout", 0.0),
                "target_modules": tuple(sorted(targets)) if not isinstance(targets, str) else targets,
                "modules_to_save": tuple(c.get("modules_to_save") or ())}

    def describe(self) -> str:
        s = self.settings()
        return f"LoRA r={s['r']} alpha={s['alpha']:g}" + (f" on {self.base}" if self.base else "")


def read_adapter(uri: str, storage_cfg=None) -> AdapterDir | None:
    """The PEFT adapter directory at `uri` (local or in storage), or None where there is none
    (no `adapter_config.json`). ModelError for one that cannot be read."""
    from rayzero.storage import Storage, StorageError

    storage = Storage(uri, storage_cfg)
    try:
        if storage.size(ADAPTER_CONFIG) is None:
            return None
        config = json.loads(storage.read_bytes(ADAPTER_CONFIG))
        identity = {}
        if storage.size(ADAPTER_WEIGHTS) is not None:
            (n,) = struct.unpack("<Q", storage.read_range(ADAPTER_WEIGHTS, 0, 8))
            if n <= 100 << 20:
                meta = json.loads(storage.read_range(ADAPTER_WEIGHTS, 8, n)).get("__metadata__") or {}
                identity = json.loads(meta.get("rayzero_model", "{}"))
    except (StorageError, OSError) as e:
        raise ModelUnavailable(f"{uri}: cannot read it ({e})") from None
    except ValueError as e:
        raise ModelError(f"{uri}: not a PEFT adapter directory ({e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{uri}/{ADAPTER_CONFIG} is not a PEFT adapter config")
    return AdapterDir(uri, config, identity if isinstance(identity, dict) else {})


def adapter_settings(adapter: AdapterDir, given) -> dict:
    """`model.lora` for a run starting from `adapter`: the adapter's settings, with those the
    run sets itself (`given`, a LoraSettings or None) kept where they may differ (dropout, which
    changes no value) and checked where they may not (the rank, alpha, the layers). ModelError
    naming the first difference, or a PEFT option rayzero does not train."""
    c = adapter.config
    if c.get("peft_type", "LORA") != "LORA":
        raise ModelError(f"model.adapter: {adapter.uri} holds a {c.get('peft_type')} adapter; rayzero trains LoRA")
    for key, plain in _UNSUPPORTED.items():
        if c.get(key, plain) not in (plain, None, {}, False):
            raise ModelError(f"model.adapter: {adapter.uri} uses PEFT's {key}={c[key]!r}, which rayzero's LoRA does "
                             "not train")
    mine = adapter.settings()
    if isinstance(mine["target_modules"], str):
        raise ModelError(f"model.adapter: {adapter.uri} names its layers by a pattern ({mine['target_modules']!r}); "
                         "give them as model.lora.target_modules=...")
    if given is None:
        return mine
    for key in sorted(given.model_fields_set):
        if key == "dropout":
            mine[key] = given.dropout
            continue
        theirs, ours = mine[key], getattr(given, key)
        same = set(theirs) == set(ours) if key in ("target_modules", "modules_to_save") else theirs == ours
        if not same:
            raise ModelError(f"model.adapter: model.lora.{key} {_listed(ours)} here, {_listed(theirs)} in the adapter "
                             f"{adapter.uri}; leave model.lora.{key} out to take the adapter's")
    return mine


def _listed(v) -> str:
    return ",".join(v) if isinstance(v, (tuple, list)) else f"{v:g}" if isinstance(v, float) else str(v)


def check_adapter_base(adapter: AdapterDir, record: dict, path: str) -> None:
    """The model a run puts `adapter` onto must be the one it was trained on, where rayzero
    wrote it (its metadata records that model's kind and config hash): ModelError leading
    with what differs."""
    was = adapter.identity
    if not was.get("config_sha256"):
        return  # PEFT's own: it names its base, which cannot be checked from here
    if was.get("kind") != record.get("kind"):
        raise ModelError(f"model.adapter: {adapter.uri} was trained on a model.kind={was.get('kind')} model, and this "
                         f"run trains model.kind={record.get('kind')}")
    if was["config_sha256"] != record.get("config_sha256"):
        trained_on = was.get("source") or adapter.base or "its base"
        if path and trained_on != path:
            raise ModelError(f"model.adapter: {adapter.uri} was trained on {trained_on} (config "
                             f"{was['config_sha256']}), not on model.path {path} (config "
                             f"{record.get('config_sha256')}); give model.path={trained_on}")
        raise ModelError(f"model.adapter: the model at {path or trained_on} is not the one {adapter.uri} was trained "
                         f"on: its config hash is {record.get('config_sha256')} now, {was['config_sha256']} then")


def adapter_source(adapter: AdapterDir, storage_cfg, adapters: dict[str, Adapter], saved: list[str],
                   shapes: dict[str, tuple[int, ...]]):
    """The adapters' (and `modules_to_save`'s) initial values from `adapter`'s weights file, by
    the keys PEFT gives them (`peft_keys`), whole (a TP rank takes its slice through
    `TPSlices`): a `SafetensorsWeights` whose names are the parameters it fills. ModelError
    listing every adapter the file lacks or holds in another shape (another rank), and every
    tensor it holds that this model has no place for."""
    from rayzero.storage import Storage
    from rayzero.models.conversions import Part
    from rayzero.models.weights import SafetensorsWeights

    storage = Storage(adapter.uri, storage_cfg)
    if storage.size(ADAPTER_WEIGHTS) is None:
        raise ModelError(f"model.adapter: {adapter.uri} has no {ADAPTER_WEIGHTS}")
    weights = SafetensorsWeights._open(storage, [ADAPTER_WEIGHTS])
    params = {name: tuple(shapes[name]) for name in peft_keys(adapters, saved).values()}
    keys = {key: name for key, name in peft_keys(adapters, saved).items() if key in weights.tensors}
    parts = {name: [Part.whole(key, weights.tensors[key].shape)] for key, name in keys.items()}
    unused = [k for k in weights.tensors if k not in keys]
    try:
        weights.use(parts, params, unused)
    except ModelError as e:
        raise ModelError(str(e).replace("model.path: the weights in", "model.adapter: the adapter in", 1)) from None
    return weights
