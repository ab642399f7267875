"""Models behind one seam (`spec.ModelSpec`): the built-in GPT, Hugging Face causal LMs, and
any `nn.Module`. `model_spec(cfg)` gives the one `model.kind` names; `spec_class(kind)` its
class, which answers for the kind where no spec is made yet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from rayzero.models.config import PRESETS, ModelConfig
from rayzero.models.errors import ModelError, ModelUnavailable

if TYPE_CHECKING:  # for the annotations; at run time `__getattr__` loads it on first use
    from rayzero.models.spec import ModelSpec


def __getattr__(name: str):
    # The seam itself imports torch: loaded on first use, so that reading a config (`rayzero
    # --help`, a config error) does not pay torch's second of imports.
    if name == "ModelSpec":
        from rayzero.models.spec import ModelSpec

        return ModelSpec
    raise AttributeError(f"module 'rayzero.models' has no attribute {name!r}")


def spec_class(kind: str | None) -> type[ModelSpec]:
    """The `ModelSpec` class of a `model.kind`, which answers for the kind before any spec is
    made (the driver's checks, a checkpoint's record); None, as a record from before kinds were
    recorded has it, is the default kind. Its module (and torch) is imported here."""
    kind = kind or ModelConfig.model_fields["kind"].default
    if kind == "hf":
        from rayzero.models.hf import HFSpec

        return HFSpec
    if kind == "module":
        from rayzero.models.module import ModuleSpec

        return ModuleSpec
    from rayzero.models.gpt import GPTSpec

    return GPTSpec


def model_spec(cfg: ModelConfig, *, seed: int, block_size: int, storage_cfg=None,
               factory: Callable | None = None) -> ModelSpec:
    """The spec of the model `cfg` describes. `block_size`: the GPT's context (the config's or
    `train.seq_len`); `storage_cfg`: S3 settings for `model.path`; `factory`: a callable given
    from Python for `model.kind=module`. Raises ModelError for a model that cannot be had."""
    return spec_class(cfg.kind).create(cfg, seed=seed, block_size=block_size, storage_cfg=storage_cfg,
                                       factory=factory)


def spec_from_manifest(manifest: dict, storage_cfg=None) -> ModelSpec:
    """The spec of the model a checkpoint was saved from, as its manifest records it (an HF
    model's config is in the record: its directory need not be there any more)."""
    cfg = ModelConfig(**manifest["model"])
    record = manifest.get("model_source") or {}
    seed = record.get("seed", manifest["data"]["seed"])
    return spec_class(cfg.kind).create(cfg, seed=seed, block_size=manifest["block_size"], storage_cfg=storage_cfg,
                                       record=record)


__all__ = ["ModelConfig", "ModelError", "ModelSpec", "ModelUnavailable", "PRESETS", "model_spec", "spec_class",
           "spec_from_manifest"]
