"""Which model to train: the built-in GPT, a Hugging Face causal LM, or a user's `nn.Module`."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from rayzero._frozen import Frozen

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=128),  # ~0.5M parameters: tests, laptops
    "small": dict(n_layer=6, n_head=6, n_embd=384),  # ~10.8M
    "medium": dict(n_layer=12, n_head=12, n_embd=768),  # ~85M, GPT-2 small's shape
    "large": dict(n_layer=24, n_head=16, n_embd=1024),  # ~303M, GPT-2 medium's shape
}
# The built-in GPT's keys, and their values when left alone (preset `tiny`): another kind of
# model must leave them so.
GPT_DEFAULTS: dict[str, Any] = {"preset": "tiny", **PRESETS["tiny"], "vocab_size": 320, "block_size": None,
                                "dropout": 0.0, "bias": True}


class LoraSettings(Frozen):
    """LoRA adapters (through PEFT) on a frozen base: only the adapters (and `modules_to_save`)
    train; the base is held in the compute dtype alone, sharded like any parameters."""

    r: int = Field(default=8, description="The adapters' rank; must be positive.")
    alpha: float = Field(default=16.0, description="The scale numerator: the adapter's output is multiplied by "
                         "alpha / r. Must be positive.")
    dropout: float = Field(default=0.0, description="Dropout on the adapters' input, in [0, 1).")
    target_modules: tuple[str, ...] = Field(
        default=(),
        description="The linear layers to adapt, by name or by the last parts of it (PEFT's rule), "
        "comma-separated, e.g. `q_proj,v_proj`; empty = PEFT's default for the architecture.",
    )
    modules_to_save: tuple[str, ...] = Field(
        default=(),
        description="Modules trained whole beside the adapters (a new head, say), comma-separated.",
    )

    @field_validator("target_modules", "modules_to_save", mode="before")
    @classmethod
    def _split(cls, v):
        return tuple(s.strip() for s in v.split(",") if s.strip()) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self):
        if self.r < 1:
            raise ValueError(f"r: the rank must be a positive whole number, got {self.r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha: must be positive, got {self.alpha:g}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout:g}")
        return self


class ModelConfig(Frozen):
    """The model: `kind` chooses the built-in GPT (shaped by `preset` and the keys after it),
    a Hugging Face causal LM from a model directory (`path`), or any `nn.Module` a factory
    returns (`factory`, `kwargs`)."""

    kind: Literal["gpt", "hf", "module"] = Field(
        default="gpt",
        description="`gpt` = the built-in GPT; `hf` = a Hugging Face causal LM from the directory `path`; "
        "`module` = the `nn.Module` that `factory` returns (its forward takes token ids [B, T] and returns "
        "logits [B, T, V], or an object with `.logits`).",
    )
    path: str = Field(
        default="",
        description="`hf`: the model directory (local path, `file://` or `s3://`) with `config.json` and "
        "optionally weights (`model.safetensors`, or `model-*.safetensors` with their index) and tokenizer "
        "files. `gpt` and `module`: optionally a safetensors file (or a directory with one) of weights by "
        "`state_dict()` names, e.g. a rayzero export, to start from. `s3://` uses the `checkpoint.s3_*` "
        "settings.",
    )
    init: Literal["auto", "pretrained", "random"] = Field(
        default="auto",
        description="`pretrained` = the weights in `path`, each rank reading only its shard; `random` = the "
        "model's own initialization, seeded by `train.seed` and each module's name; `auto` = `pretrained` "
        "where `path` holds weights, else `random`.",
    )
    factory: str = Field(
        default="",
        description="`module`: `package.module:callable` returning the `nn.Module`, called with `kwargs`.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="`module`: keyword arguments for `factory`.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="`hf`: allow model code shipped in the model directory (`auto_map` in `config.json`).",
    )
    freeze: tuple[str, ...] = Field(
        default=(),
        description="Parameters to keep frozen (no gradient, no optimizer state), as `fnmatch` patterns of "
        "their names, comma-separated on the command line, e.g. `model.embed_tokens.*`.",
    )
    lora: LoraSettings | None = Field(
        default=None,
        description="LoRA fine-tuning (`r`, `alpha`, `dropout`, `target_modules`, `modules_to_save`): adapters "
        "added with PEFT before sharding, the base weights frozen; `null` = full fine-tuning. Set any key to turn "
        "it on, e.g. `model.lora.r=8`.",
    )
    adapter: str = Field(
        default="",
        description="A PEFT LoRA adapter directory (`adapter_config.json`, `adapter_model.safetensors`: a "
        "`save_format=peft` export, or PEFT's own `save_pretrained`) to start from: its adapters are the initial "
        "values, and `lora` takes its settings (keys set here must agree, but `dropout`). `path` is the base it "
        "was trained on (empty = the base the adapter names). A PEFT adapter directory given as `path` is taken "
        "as this.",
    )
    activation_checkpointing: str = Field(
        default="none",
        description="Recompute activations in backward instead of keeping them: `none`; `full` = every block "
        "(the model's repeated layers, or `recompute_blocks`) keeps only its input; `every:N` = every N-th "
        "block does; `selective` = every block keeps its matrix multiplications' outputs and recomputes the rest.",
    )
    recompute_blocks: tuple[str, ...] = Field(
        default=(),
        description="The module classes activation checkpointing recomputes, comma-separated; empty = the "
        "model's own blocks (the GPT's `Block`, an HF model's `_no_split_modules`, a module's largest list of "
        "layers).",
    )
    preset: Literal["tiny", "small", "medium", "large"] = Field(
        default="tiny",
        description="`gpt`: model size: `tiny` (~0.5M parameters), `small` (~10.8M), `medium` (~85M, GPT-2 "
        "small's shape), `large` (~303M, GPT-2 medium's shape).",
    )
    n_layer: int | None = Field(default=None, description="`gpt`: transformer blocks; `null` = from `preset`.")
    n_head: int | None = Field(
        default=None,
        description="`gpt`: attention heads per block; must divide `n_embd`. `null` = from `preset`.",
    )
    n_embd: int | None = Field(default=None, description="`gpt`: embedding width; `null` = from `preset`.")
    vocab_size: int = Field(
        default=320,
        description="`gpt`: token vocabulary: 257 byte tokens (256 bytes + end-of-text) padded up to a "
        "multiple of 64; at least the dataset's.",
    )
    block_size: int | None = Field(
        default=None,
        description="`gpt`: maximum context length in tokens, at least `train.seq_len`; `null` = "
        "`train.seq_len`.",
    )
    dropout: float = Field(default=0.0, description="`gpt`: dropout probability, in [0, 1); 0 disables it.")
    bias: bool = Field(default=True, description="`gpt`: biases in the linear layers and layer norms.")

    @field_validator("activation_checkpointing")
    @classmethod
    def _mode(cls, v: str) -> str:
        if v in ("none", "full", "selective"):
            return v
        head, _, n = v.partition(":")
        if head == "every" and n.isdigit() and int(n) >= 1:
            return f"every:{int(n)}"
        raise ValueError("expected none, full, every:N (N a whole number >= 1) or selective")

    @property
    def checkpoint_every(self) -> int:
        """Every how many blocks one is recomputed (1 for `full` and `selective`; 0: none)."""
        mode = self.activation_checkpointing
        return 0 if mode == "none" else int(mode.partition(":")[2]) if mode.startswith("every:") else 1

    @field_validator("freeze", "recompute_blocks", mode="before")
    @classmethod
    def _split(cls, v):
        return tuple(s.strip() for s in v.split(",") if s.strip()) if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data):
        """`checkpoint_blocks`, the old name of `recompute_blocks`, read as it."""
        if isinstance(data, dict) and "checkpoint_blocks" in data:
            data = {**{k: v for k, v in data.items() if k != "checkpoint_blocks"},
                    "recompute_blocks": data["checkpoint_blocks"]}
        return data

    @field_validator("kwargs", mode="before")
    @classmethod
    def _parse(cls, v):
        # From the command line: model.kwargs={"dim": 64} as a whole, or model.kwargs.dim=64
        # one key at a time; each text value is read as YAML (64 -> int, true -> bool).
        if isinstance(v, str):
            try:
                v = yaml.safe_load(v)
            except yaml.YAMLError as e:
                raise ValueError(f"not a mapping: {e}") from None
            return {} if v is None else v
        if isinstance(v, dict):
            return {k: _scalar(x) for k, x in v.items()}
        return v

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data):
        if isinstance(data, dict):
            preset = data.get("preset", "tiny")
            if preset in PRESETS:
                data = {**PRESETS[preset], **{k: v for k, v in data.items() if v is not None}}
        return data

    @model_validator(mode="after")
    def _check(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.kind != "gpt":
            changed = [k for k, v in GPT_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"{', '.join(changed)}: only for model.kind=gpt (this is model.kind={self.kind}; "
                                 "an HF model's shape is in its config.json, a module's in model.kwargs)")
        if self.kind == "hf" and not self.path and not self.adapter:
            raise ValueError("path: model.kind=hf needs the model directory (config.json, and weights to "
                             "fine-tune)")
        if self.kind != "module" and (self.factory or self.kwargs):
            raise ValueError("factory, kwargs: only for model.kind=module")
        if self.kind != "hf" and self.trust_remote_code:
            raise ValueError("trust_remote_code: only for model.kind=hf")
        if self.lora is not None and self.freeze:
            raise ValueError("freeze: model.lora already freezes every base weight; to train a module whole "
                             "beside the adapters, name it in model.lora.modules_to_save")
        if self.init == "pretrained" and not self.path:
            raise ValueError("init: pretrained needs model.path (the weights to start from)")
        return self

    def exports_hf_dir(self) -> bool:
        """Whether a whole export of the model may be an HF directory (`train.save_format=hf`):
        an HF model's. Asked of the config, beside its other rules by kind, and not of the spec
        class, whose module imports torch: a config error answers at once."""
        return self.kind == "hf"

    def samples_with_cache(self) -> bool:
        """Whether generation can keep a transformers KV cache of many rows (`rollout.slots`, a
        continuous batch): an HF causal LM's; the built-in GPT and a module recompute a group."""
        return self.kind == "hf"


def _scalar(v):
    if not isinstance(v, str):
        return v
    try:
        return yaml.safe_load(v)
    except yaml.YAMLError:
        return v
