"""Hugging Face causal LMs behind the model seam: any model transformers builds from a config.

`model.path` is a model directory (local, `file://` or `s3://`) with `config.json` and
optionally safetensors weights and tokenizer files. The model is built with
`AutoModelForCausalLM.from_config` with its parameters on the meta device; it starts from the
directory's weights (each rank reading only its shard) or from the model's own `_init_weights`,
module by module, seeded by name. An export is a directory `from_pretrained` loads.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from rayzero.storage import Storage, StorageError
from rayzero.models.config import ModelConfig
from rayzero.models.conversions import Part, load_layout, saved_keys
from rayzero.models.init import SeededInit, params_on_meta
from rayzero.models.routers import RouterLosses
from rayzero.models.spec import (
    ExportEntry, ModelError, ModelSpec, ModelUnavailable, global_shapes, weights_record,
)
from rayzero.sharding.flat_buffer import ParamSource

log = logging.getLogger(__name__)
CONFIG = "config.json"
# What an export copies from the model directory besides the weights and config.json.
COMPANIONS = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "vocab.txt", "merges.txt", "*.model", "chat_template*", "preprocessor_config.json")


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()  # its progress bars and notes are not ours to print
    return transformers


class HFSpec(RouterLosses, ModelSpec):
    kind = "hf"

    def __init__(self, cfg: ModelConfig, seed: int, storage_cfg=None, config: dict | None = None):
        """`config`: the model's config as a dict (a checkpoint's record of it), instead of
        reading `config.json` from `model.path`."""
        super().__init__(cfg, seed, storage_cfg)
        self.path = cfg.path
        if config is None:
            self.config_bytes, self.config = load_hf_config(cfg.path, storage_cfg, cfg.trust_remote_code)
            check_causal_lm(self.config, cfg.path, cfg.trust_remote_code)
        else:
            self.config = config_from_dict(config)
            self.config_bytes = json.dumps(config, sort_keys=True).encode()

    @classmethod
    def create(cls, cfg: ModelConfig, *, seed: int, block_size: int, storage_cfg=None, factory=None,
               record: dict | None = None) -> HFSpec:
        return cls(cfg, seed, storage_cfg, config=(record or {}).get("config"))

    @classmethod
    def model_dir(cls, cfg: ModelConfig) -> str | None:
        return cfg.path

    @classmethod
    def context_length(cls, cfg: ModelConfig, storage_cfg=None) -> int | None:
        """`max_position_embeddings` (`n_positions`) of the directory's config.json."""
        c = load_hf_config(cfg.path, storage_cfg, cfg.trust_remote_code)[1].get_text_config()
        return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)

    @classmethod
    def architecture(cls, record: dict) -> str | None:
        return (record.get("architectures") or [None])[0]

    @classmethod
    def describe(cls, record: dict) -> str:
        arch = cls.architecture(record) or record.get("config", {}).get("model_type", "an HF model")
        return f"{arch} from {record.get('source')}"

    @property
    def where(self) -> str:
        return f"model.path={self.path}"

    @property
    def text_config(self):
        return self.config.get_text_config()

    # -- building ------------------------------------------------------------------------
    def _build(self) -> nn.Module:
        tf = _transformers()
        config = copy.deepcopy(self.config)
        config.use_cache = False  # training: no key/value cache
        try:
            with params_on_meta():
                model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                            trust_remote_code=self.cfg.trust_remote_code)
        except (ValueError, KeyError, TypeError, ImportError, OSError) as e:
            raise ModelError(f"{self.where}: transformers cannot build {type(self.config).__name__} "
                             f"(model_type {getattr(self.config, 'model_type', '?')!r}) as a causal LM: "
                             f"{str(e).strip().splitlines()[0]}") from None
        return model

    def seeded(self, model: nn.Module) -> ParamSource:
        tf = _transformers()
        twin = self._build()
        fns: dict[str, object] = {}
        for name, m in twin.named_modules():  # parents first: a sub-model brings its own init
            fns[name] = m._init_weights if isinstance(m, tf.PreTrainedModel) else fns[name.rpartition(".")[0]]

        def fallback() -> nn.Module:
            return tf.AutoModelForCausalLM.from_config(self.config, dtype=torch.float32,
                                                       trust_remote_code=self.cfg.trust_remote_code)

        return SeededInit(twin, self.seed, lambda name, _m: fns[name], fallback)

    def resolve(self, model: nn.Module, skip: frozenset[str] = frozenset(),
                shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """Match the checkpoint's tensors to the model's parameters as `from_pretrained` does:
        through the architecture's weight conversions (renamed tensors, per-expert tensors that
        make one fused parameter), a checkpoint of the base model (GPT-2's `h.0...`) under the
        causal LM's prefix. ModelError listing every mismatch; UnsupportedConversion naming a
        transform ranged reads cannot follow."""
        if getattr(self, "_resolved", False):
            return
        params = global_shapes(model, skip, shapes)
        keys = {k: info.shape for k, info in self.weights.tensors.items()}
        layout = load_layout(model, keys, params)
        prefix = getattr(model, "base_model_prefix", "")
        passed = (set(model.state_dict(keep_vars=True)) - set(params)) | self._ignored(model)
        unused = [k for k in layout.unused
                  if not {k, k.removeprefix(prefix + "."), f"{prefix}.{k}"} & passed]
        self.weights.use(layout.parts, params, unused)
        self._resolved = True

    def _ignored(self, model: nn.Module) -> set[str]:
        patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
        return super()._ignored(model) | {k for k in self.weights.tensors if any(_matches(p, k) for p in patterns)}

    def fsdp_units(self, model: nn.Module) -> tuple[str, ...]:
        """The classes in the model's `_no_split_modules` (its decoder layer), and those of its
        input embedding and output head: units of their own, gathered only where they are used,
        rather than held whole from the first forward to the last backward in the root unit
        (with a large vocabulary they are the largest tensors of the model)."""
        layers = set(getattr(model, "_no_split_modules", None) or ())
        if not layers:
            raise ModelError(f"{self.where}: {type(model).__name__} names no _no_split_modules, so ZeRO-3 has no "
                             "default units; set sharding.fsdp_units to its decoder layer's class")
        ends = {type(m).__name__ for m in (model.get_input_embeddings(), model.get_output_embeddings())
                if m is not None}
        return tuple(sorted(layers)) + tuple(sorted(ends - layers))

    def blocks(self, model: nn.Module) -> tuple[str, ...]:
        """The model's `_no_split_modules`: its decoder layer."""
        layers = tuple(sorted(getattr(model, "_no_split_modules", None) or ()))
        if not layers:
            raise ModelError(f"{self.where}: {type(model).__name__} names no _no_split_modules, so activation "
                             "checkpointing has no default blocks; set model.recompute_blocks to its layer's class")
        return layers

    # -- tensor parallelism -------------------------------------------------------------
    def tp_plan(self, model: nn.Module) -> dict:
        """transformers' own plan (`hf_plan.py`)."""
        from rayzero.models.hf_plan import tp_plan

        plan = getattr(self.text_config, "base_model_tp_plan", None)
        if not plan:
            super().tp_plan(model)
        return tp_plan(model, self.text_config, plan)

    def sequence_ends(self, model: nn.Module) -> tuple[str, str]:
        """The first decoder layer and the decoder's final norm (`model.norm`)."""
        classes = set(self.blocks(model))
        names = {id(m): n for n, m in model.named_modules()}
        first = next(n for n, m in model.named_modules() if type(m).__name__ in classes)
        norm = getattr(model.get_decoder(), "norm", None)
        if norm is None:
            raise ModelError(f"parallel.sequence_parallel: {type(model).__name__}'s decoder has no final `norm`")
        return first, names[id(norm)]

    def vocab_ends(self, model: nn.Module) -> tuple[str | None, str | None]:
        """The modules `get_input_embeddings()` and `get_output_embeddings()` give."""
        names = {id(m): n for n, m in model.named_modules()}
        ends = (model.get_input_embeddings(), model.get_output_embeddings())
        return tuple(names.get(id(m)) if m is not None else None for m in ends)

    def parallelize(self, model: nn.Module, axis, sequence_parallel: bool = False, vocab_parallel: bool = True,
                    streams=None):
        """transformers' attention takes its head counts from the shapes, but for the ratio
        of query to key/value heads (`num_key_value_groups`): set to this rank's."""
        layout = super().parallelize(model, axis, sequence_parallel, vocab_parallel, streams)
        if sequence_parallel:
            self._split_tokens(model, "tp", axis)
        for m in model.modules():
            if hasattr(m, "num_key_value_groups") and hasattr(m, "q_proj") and hasattr(m, "k_proj"):
                q, k = (getattr(p, "base_layer", p) for p in (m.q_proj, m.k_proj))  # under LoRA: its base
                rows = k.rows if hasattr(k, "rows") else slice(0, k.out_features)
                m.num_key_value_groups = q.out_features // (rows.stop - rows.start)
        return layout

    splits_sequence = True

    def context_parallel(self, model: nn.Module, cp) -> None:
        """Through transformers' attention-function registry (`hf_context.py`); a mixture of
        experts' load-balancing loss over the whole cp group's tokens (`routers.Balance`)."""
        from rayzero.models.hf_context import attend_across

        c = self.text_config
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
        cp.check_heads(heads, getattr(c, "num_key_value_heads", None) or heads)
        self._cp_calls = attend_across(model, cp, c)
        self._split_tokens(model, "cp", cp.axis)

    def attention_shape(self, model: nn.Module) -> tuple[int, int] | None:
        c = self.text_config
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", None)
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None)
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
        if not (layers and heads and hidden):
            return None
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        return layers, heads * head_dim

    def activation_shape(self, model: nn.Module):
        from rayzero.sharding.memory import ActivationShape

        shape = self.attention_shape(model)
        c = self.text_config
        if shape is None:
            return None
        layers, width = shape
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head")
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd")
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
        active = getattr(c, "num_experts_per_tok", None)
        if active and getattr(c, "moe_intermediate_size", None):  # a mixture of experts: the experts a token uses
            ffn = active * c.moe_intermediate_size + (getattr(c, "shared_expert_intermediate_size", 0) or 0)
        elif active:
            ffn = active * ffn
        act = str(getattr(c, "hidden_act", None) or getattr(c, "activation_function", "")).lower()
        return ActivationShape(
            layers=layers, hidden=hidden, heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            ffn=ffn, gated=act in ("silu", "swish", "swiglu"), rms_norm=hasattr(c, "rms_norm_eps"),
            vocab=self.vocab_size,
            fused_attention=getattr(self.config, "_attn_implementation", "sdpa") != "eager",
            dropout=float(getattr(c, "attention_dropout", 0.0) or getattr(c, "hidden_dropout", 0.0) or 0.0))

    # -- training ------------------------------------------------------------------------
    @property
    def aux_coef(self) -> float:
        """A mixture of experts' `router_aux_loss_coef` (Mixtral, Qwen2-MoE, OLMoE, …): its
        router's load-balancing loss joins the training loss with that weight, as transformers
        adds it when given labels; 0 for a model without one."""
        c = self.text_config
        return float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0) if hasattr(c, "output_router_logits") else 0.0

    def logits(self, model: nn.Module, batch):
        """The model's forward; packed rows' examples kept apart by their `position_ids`, which
        restart at each example: transformers builds the block-diagonal causal mask from them
        (sdpa, eager, flex; flash-attention takes them as its variable-length sequences), or,
        across a context-parallel split, `cp.attend` takes each token's example start."""
        kwargs = {"input_ids": batch.tokens}
        if self.aux_coef:
            kwargs["output_router_logits"] = True
        if batch.documents is not None:
            kwargs["use_cache"] = False  # transformers finds packed sequences only without a cache
            kwargs["position_ids"] = self.positions(batch)
            if self.cp is not None:
                from rayzero.models.hf_context import packed_across

                return packed_across(model, kwargs, batch.documents, self._cp_calls)
        return model(**kwargs)

    def check_documents(self, model: nn.Module, why: str) -> None:
        """Packed examples are kept apart by `position_ids`, from which transformers' own masks
        (`masking_utils`) find where each example starts: a family that builds its masks another
        way, or takes no positions, is refused."""
        import inspect
        import sys

        module = sys.modules.get(type(model).__module__)
        takes = "position_ids" in inspect.signature(model.forward).parameters
        if not takes or not hasattr(module, "create_causal_mask"):
            raise ModelError(f"{self.where}: {why} packs several examples into each row, and {type(model).__name__} "
                             "does not build its attention mask from position_ids (transformers' masking_utils), so "
                             "they would attend to each other")

    def expert_parallel(self, model: nn.Module, ep) -> dict[str, tuple[int, ...]]:
        """Through transformers' experts registry (`hf_experts.py`)."""
        from rayzero.models.hf_experts import split_experts

        return split_experts(model, ep, str(self.path))

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def max_positions(self) -> int | None:
        c = self.text_config
        return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)

    def check(self, seq_len: int, data_vocab: int | None = None) -> None:
        super().check(seq_len, data_vocab)
        if self.max_positions is not None and seq_len > self.max_positions:
            raise ModelError(f"train.seq_len: {seq_len} exceeds the model's {self.max_positions} positions "
                             f"(max_position_embeddings in {self.path}/{CONFIG})")
        model = self.build()
        if self.weights is not None:
            self.resolve(model)

    # -- records and exports -----------------------------------------------------------
    def record(self) -> dict:
        return {"kind": self.kind, "config": json.loads(self.config.to_json_string(use_diff=False)),
                "config_sha256": hashlib.sha256(self.config_bytes).hexdigest()[:16], "seed": self.seed,
                "architectures": getattr(self.config, "architectures", None),
                **weights_record(self.weights, self.path), **self.adapter_record()}

    def export_plan(self, model: nn.Module) -> list[ExportEntry]:
        """As `save_pretrained` writes them: each parameter once (a tied head is not written;
        transformers ties it again on load), under the names and in the pieces of the
        architecture's checkpoint layout (GPT-NeoX's `embed_out`, a mixture of experts' tensors
        per expert), and the persistent buffers."""
        names = {id(p): n for n, p in model.named_parameters()}
        params, plan, seen = {}, [], set()
        for key, v in model.state_dict(keep_vars=True).items():
            if id(v) in names:
                if id(v) not in seen:
                    params[names[id(v)]] = tuple(v.shape)
                    seen.add(id(v))
            else:
                plan.append(ExportEntry(key, tuple(v.shape), buffer=v.detach()))
        saved = saved_keys(model, params)
        by_key: dict[str, list] = {}
        for name, parts in load_layout(model, saved, params).parts.items():
            for part in parts:
                by_key.setdefault(part.key, []).append((name, part))
        for key, pieces in by_key.items():
            (name, part), whole = pieces[0], len(pieces) == 1 and pieces[0][1] == Part.whole(key, params[pieces[0][0]])
            plan.append(ExportEntry(key, saved[key], param=name, parts=() if whole else tuple(pieces)))
        return plan


    def export_dtype(self, dtype: str = "auto") -> str:
        """`auto`: the pretrained weights' dtype, else the config's own (`dtype`), else float32."""
        if dtype != "auto" or self.weights is not None:
            return super().export_dtype(dtype)
        own = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        own = str(own).removeprefix("torch.") if own is not None else "float32"
        return own if own in ("float32", "bfloat16", "float16") else "float32"

    def export_files(self, dtype: str) -> dict[str, bytes]:
        """config.json with the export's dtype, and generation config and tokenizer files
        copied from `model.path` where it still has them."""
        files: dict[str, bytes] = {}
        try:
            files.update(companion_files(self.path, self.storage_cfg))
        except (StorageError, OSError) as e:
            log.warning("model.path %s cannot be read (%s): the export has no tokenizer or generation config",
                        self.path, e)
        config = json.loads(self.config.to_json_string(use_diff=False))
        files["config.json"] = export_config(config, dtype)
        return files


def check_causal_lm(config, path: str, trust_remote_code: bool = False) -> None:
    """Refuse a model that is not a decoder-only causal LM (ModelError naming what it is):
    next-token training of a model whose attention sees the whole sequence learns nothing
    usable. An encoder-decoder (T5, BART) is refused; so is an encoder family (BERT, RoBERTa:
    transformers has a masked-LM head for it) unless its config sets `is_decoder`, which
    makes its attention causal; and a `model_type` transformers has no causal LM class for."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind, name = getattr(config, "model_type", "?"), type(config).__name__
    trains = "rayzero trains decoder-only causal LMs (Llama, Qwen2, Mistral, GPT-2, ...)"
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model.path: {path} holds an encoder-decoder model ({name}, model_type {kind!r}); {trains}")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise ModelError(f"model.path: {path} holds an encoder ({name}, model_type {kind!r}) whose attention sees the "
                         f"whole sequence, so next-token training would learn nothing usable; {trains}. To train it "
                         "as a decoder, set \"is_decoder\": true in its config.json")
    custom = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not custom:
        raise ModelError(f"model.path: {path} holds a {name} (model_type {kind!r}), which transformers has no causal "
                         f"LM for; {trains}")


def config_from_dict(config: dict):
    tf = _transformers()
    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return tf.AutoConfig.for_model(config["model_type"], **rest)
    except (KeyError, ValueError) as e:
        raise ModelError(f"transformers cannot rebuild the config of model_type {config.get('model_type')!r}: {e}") from None


def _matches(pattern: str, key: str) -> bool:
    import re

    try:
        return re.search(pattern, key) is not None
    except re.error:
        return False


def _what_is_there(storage: Storage) -> str:
    """Why a model directory has no config: nothing there at all, a file, or a folder without one."""
    import pyarrow.fs as pafs

    try:
        kind = storage.fs.get_file_info(storage.base).type
    except OSError:
        kind = None
    if kind == pafs.FileType.NotFound:
        return "does not exist"
    if kind == pafs.FileType.File:
        return "is a file, not a directory"
    return f"has no {CONFIG}"


def load_hf_config(path: str, storage_cfg=None, trust_remote_code: bool = False):
    """(the bytes of `config.json`, the transformers config) of a model directory; ModelError
    naming the directory when it has none, or transformers cannot read it."""
    tf = _transformers()
    storage = None
    try:
        storage = Storage(path, storage_cfg)
        raw = storage.read_bytes(CONFIG)
    except FileNotFoundError:
        raise ModelError(f"model.path: {path} {_what_is_there(storage)} (expected a Hugging Face model directory, "
                         f"as save_pretrained writes)") from None
    except StorageError as e:
        there = _what_is_there(storage) if storage is not None else f"has no {CONFIG}"
        if there != f"has no {CONFIG}":  # a file, or nothing: not storage this machine cannot reach
            raise ModelError(f"model.path: {path} {there} (expected a Hugging Face model directory, as "
                             f"save_pretrained writes)") from None
        raise ModelUnavailable(f"model.path: cannot read {path}: {e}") from None
    local = None if "://" in path and not path.startswith("file://") else Path(storage.base)
    try:
        if local is not None:
            config = tf.AutoConfig.from_pretrained(str(local), trust_remote_code=trust_remote_code)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, CONFIG).write_bytes(raw)
                config = tf.AutoConfig.from_pretrained(tmp, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"model.path: transformers cannot read {path}/{CONFIG}: {first}") from None
    return raw, config


def model_tokenizer(path: str, storage_cfg=None):
    """The model directory's tokenizer as `AutoTokenizer.from_pretrained(path)` gives it (the
    class from tokenizer_config.json, else from config.json's model_type): the one tokenizer
    rayzero uses for this model, in `data prepare`, training's check, `generate` and exports.
    A directory in storage is read into a temporary one first. None when it holds no
    tokenizer files; a DataError when they do not load."""
    from rayzero.data.tokenizer import HFTokenizer, is_tokenizer_file, tokenizer_from_files

    storage = Storage(path, storage_cfg)
    if "://" not in path or path.startswith("file://"):
        local = Path(storage.base)
        if not local.is_dir() or not any(is_tokenizer_file(p.name) for p in local.iterdir() if p.is_file()):
            return None
        return HFTokenizer(local)
    files = {n: b for n, b in companion_files(path, storage_cfg).items() if is_tokenizer_file(n)}
    if not files:
        return None
    try:
        files[CONFIG] = storage.read_bytes(CONFIG)
    except FileNotFoundError:
        pass
    return tokenizer_from_files(files, name=path.rstrip("/").rpartition("/")[2])


def companion_files(path: str, storage_cfg=None) -> dict[str, bytes]:
    """The files an HF export copies from the model directory: generation config, tokenizer."""
    from rayzero.models.weights import model_files

    storage = Storage(path, storage_cfg)
    names = [n for n in model_files(storage) if any(fnmatch.fnmatchcase(n, pat) for pat in COMPANIONS)]
    return {n: storage.read_bytes(n) for n in names}


def export_config(config: dict, dtype: str) -> bytes:
    """`config.json` for an export: the model's config with the dtype its weights are in."""
    config = dict(config)
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    config.setdefault("use_cache", True)
    return (json.dumps(config, indent=2, sort_keys=True) + os.linesep).encode()
