"""Models behind one seam (`spec.ModelSpec`): the built-in GPT, Hugging Face causal LMs, and
any `nn.Module`. `model_spec(cfg)` gives the one `model.kind` names."""

from __future__ import annotations

from typing import Callable

from rayzero.models.config import PRESETS, ModelConfig
from rayzero.models.errors import ModelError, ModelUnavailable


def __getattr__(name: str):
    # The seam itself imports torch: loaded on first use, so that reading a config (`rayzero
    # --help`, a config error) does not pay torch's second of imports.
    if name == "ModelSpec":
        from rayzero.models.spec import ModelSpec

        return ModelSpec
    raise AttributeError(f"module 'rayzero.models' has no attribute {name!r}")


def model_spec(cfg: ModelConfig, *, seed: int, block_size: int, storage_cfg=None,
               factory: Callable | None = None) -> ModelSpec:
    """The spec of the model `cfg` describes. `block_size`: the GPT's context (the config's or
    `train.seq_len`); `storage_cfg`: S3 settings for `model.path`; `factory`: a callable given
    from Python for `model.kind=module`. Raises ModelError for a model that cannot be had."""
    if cfg.kind == "hf":
        from rayzero.models.hf import HFSpec

        return HFSpec(cfg, seed, storage_cfg)
    if cfg.kind == "module":
        from rayzero.models.module import ModuleSpec

        return ModuleSpec(cfg, seed, factory, storage_cfg)
    from rayzero.models.gpt import GPTSpec

    return GPTSpec(cfg, seed, block_size, storage_cfg)


def spec_from_manifest(manifest: dict, storage_cfg=None) -> ModelSpec:
    """The spec of the model a checkpoint was saved from, as its manifest records it (an HF
    model's config is in the record: its directory need not be there any more)."""
    cfg = ModelConfig(**manifest["model"])
    record = manifest.get("model_source") or {}
    seed = record.get("seed", manifest["data"]["seed"])
    if cfg.kind == "hf":
        from rayzero.models.hf import HFSpec

        return HFSpec(cfg, seed, storage_cfg, config=record.get("config"))
    return model_spec(cfg, seed=seed, block_size=manifest["block_size"], storage_cfg=storage_cfg)


__all__ = ["ModelConfig", "ModelError", "ModelSpec", "ModelUnavailable", "PRESETS", "model_spec",
           "spec_from_manifest"]
