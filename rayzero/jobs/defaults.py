"""The defaults a run takes for the keys its config leaves unset, by how it starts.

From pretrained weights (`model.path` holding weights, or `model.adapter`) a run is a fine-tune,
and the keys below default to what TRL's `SFTConfig` (and `transformers.TrainingArguments` under
it) and PEFT publish, full fine-tuning and LoRA apart; from a config (random init) they stay the
pretraining defaults the configuration reference lists. A key the user sets always wins.

    key                  pretraining   fine-tuning                   from
    optim.lr             3e-3          2e-5 (LoRA 2e-4)              SFTConfig; PEFT: ~10x for LoRA
                                       dpo: 1e-6 (LoRA 1e-5)         DPOConfig
    optim.weight_decay   0.1           0                             TrainingArguments
    optim.beta2          0.95          0.999                         TrainingArguments
    optim.warmup_steps   10            0                             TrainingArguments
    optim.schedule       cosine        linear, to optim.min_lr 0     TrainingArguments
    train.seq_len        128           1024, at most the model's     SFTConfig, DPOConfig max_length
    data.epochs          0 (steps)     3, with train.steps unset     TrainingArguments

`train.seq_len`'s fine-tuning default is capped by the positions the model takes
(`max_position_embeddings`). Which set applies, and why, is one line of the dry run and of the
run's start (`Defaults.line`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayzero.config import RootConfig

FINE_TUNING = {"optim.weight_decay": 0.0, "optim.beta2": 0.999, "optim.warmup_steps": 0, "optim.schedule": "linear",
               "optim.min_lr": 0.0}
MAX_LENGTH = 1024  # TRL's max_length: a fine-tune's window, where the model takes that many positions
EPOCHS = 3  # TrainingArguments' num_train_epochs: a fine-tune's length when neither it nor train.steps is set


# What the defaults cover, for the line that says which apply (`optim.min_lr` is said where a fine-tune sets it)
COVERED = ("optim.lr", "optim.weight_decay", "optim.beta2", "optim.warmup_steps", "optim.schedule", "optim.min_lr",
           "train.seq_len", "train.steps", "data.epochs")


@dataclass(frozen=True)
class Defaults:
    """Which defaults a run takes: `name` (fine-tuning, LoRA fine-tuning, pretraining), `why`
    (what its start is), the values they gave the keys left unset (`applied`, a fine-tune's) and
    what the covered keys left unset hold (`values`)."""

    name: str
    why: str
    applied: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def fine_tuning(self) -> bool:
        return self.name != "pretraining"

    def line(self) -> str:
        """The set in one line, as the dry run and the run's start say it."""
        given = ", ".join(f"{k}={_value(v)}" for k, v in self.values.items())
        return f"{self.name} defaults ({self.why}): {given or 'every key they cover is set'}; a key you set wins"


def _value(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def unset_values(cfg: RootConfig, applied: dict[str, Any]) -> dict[str, Any]:
    """The covered keys' values the run takes from a default: those a fine-tune gave, and the
    pretraining ones of the rest left unset (`optim.min_lr` and `data.epochs` only where given)."""
    out = {}
    for key in COVERED:
        if key in applied:
            out[key] = applied[key]
        elif not cfg.is_set(key) and key not in ("optim.min_lr", "data.epochs"):
            section, _, name = key.partition(".")
            if key == "train.steps" and ("data.epochs" in applied or cfg.data.epochs):
                continue  # the epochs set the run's length
            out[key] = getattr(getattr(cfg, section), name)
    return out


def how_it_starts(cfg: RootConfig) -> tuple[bool | None, str]:
    """(whether the run starts from pretrained weights, in words why); None where the model's
    storage cannot be read from here (the pretraining defaults then apply, and the words say so)."""
    from rayzero.models.errors import ModelError, ModelUnavailable
    from rayzero.models.spec import pretrained_weights

    m = cfg.model
    if m.adapter:
        return True, f"model.adapter {m.adapter} on pretrained weights"
    if not m.path or m.init == "random":
        return False, "random init" + (" (model.init=random)" if m.path else "")
    try:
        weights = pretrained_weights(m, cfg.checkpoint)
    except ModelUnavailable:
        return None, f"model.path {m.path} is not read from here"
    except ModelError:  # no weights where they are required: said by the model's own checks
        return False, f"model.path {m.path} holds no weights"
    if weights is None and "://" not in m.path and not (Path(m.path) / "config.json").is_file():
        return False, f"model.path {m.path} holds no model"  # said by the model's own checks
    if weights is None:
        return False, f"model.path {m.path} holds a config and no weights: random init"
    return True, f"model.path {m.path} holds pretrained weights"


def with_defaults(cfg: RootConfig) -> tuple[RootConfig, Defaults]:
    """`cfg` with the defaults of how it starts given to the keys it leaves unset, and which
    they are. Called once, by the driver, before anything reads the keys it sets; the same
    config every time (so that rerunning the command resumes)."""
    from rayzero.models import ModelError, spec_class

    pretrained, why = how_it_starts(cfg)
    if not pretrained:
        return cfg, Defaults("pretraining", why, values=unset_values(cfg, {}))
    lora = cfg.model.lora is not None
    from rayzero.objectives.registry import objective_class

    want = {"optim.lr": objective_class(cfg.train.objective).fine_tuning_lr[int(lora)], **FINE_TUNING}
    try:
        longest = spec_class(cfg.model.kind).context_length(cfg.model, cfg.checkpoint)
    except ModelError:  # the model's own checks say what is wrong with it
        longest = None
    want["train.seq_len"] = min(MAX_LENGTH, longest) if longest else MAX_LENGTH
    if not cfg.is_set("train.steps"):
        want["data.epochs"] = EPOCHS
    applied = {k: v for k, v in want.items() if not cfg.is_set(k)}
    name = "LoRA fine-tuning" if lora else "fine-tuning"
    done = cfg.override(*(f"{k}={v}" for k, v in applied.items())) if applied else cfg
    return done, Defaults(name, why, applied, unset_values(cfg, applied))
