"""The objectives a run can train for, as the config and the CLI see them, without torch: each
built-in one by name (`OBJECTIVES`: where its code is, and the checks its options take), its
options' section (`DPOConfig`), a user's own by `package.module:Class`. The objectives' code is in
their own files (`next_token.py`, `dpo.py`), imported when a run makes one (`registry.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import Field

from rayzero._frozen import Frozen


class DPOConfig(Frozen):
    """Preference tuning (`train.objective=dpo`), in the terms of TRL's `DPOConfig`: the loss
    over pairs of completions (chosen, rejected) to one prompt, and its reference model."""

    beta: float = Field(
        default=0.1, gt=0,
        description="How far the policy may move from the reference: the rewards are beta x (log-prob of the "
        "policy - log-prob of the reference); for `ipo`, the regularization tau; for `orpo`, the weight of the "
        "odds-ratio term (TRL's ORPO beta, lambda in the paper).",
    )
    loss: Literal["sigmoid", "ipo", "hinge", "robust", "orpo"] = Field(
        default="sigmoid",
        description="`sigmoid` = DPO (-log sigmoid(beta x margin)); `ipo` = IPO's squared loss on the margin per "
        "completion token; `hinge` = SLiC's relu(1 - beta x margin); `robust` = robust DPO under flipped labels "
        "(`label_smoothing` the flip rate); `orpo` = ORPO, reference-free: the chosen completions' NLL plus beta x "
        "the odds-ratio loss, with no reference model.",
    )
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5,
        description="The share of preference labels taken to be wrong, for `robust` (as TRL: the other losses "
        "take none, and a value for them is refused rather than ignored).",
    )
    disable_dropout: bool = Field(
        default=True,
        description="No dropout in the policy: its dropout modules set to p=0, as TRL's `disable_dropout` (its "
        "default) does, and its attention's dropout rate too; the reference always runs in eval mode.",
    )
    precompute_ref: bool = Field(
        default=False,
        description="Compute the reference log-probabilities of every training and validation pair in one pass "
        "before training, then drop the reference model (TRL's `precompute_ref_log_probs`); not with `orpo`, "
        "which has no reference.",
    )

    @property
    def uses_reference(self) -> bool:
        return self.loss != "orpo"


def check_dpo(cfg) -> None:
    """What preference tuning refuses, before anything starts."""
    t, d = cfg.train, cfg.dpo
    if t.micro_batch_size % 2:
        raise ValueError(f"train.micro_batch_size: {t.micro_batch_size} would split a preference pair (chosen and "
                         "rejected are two sequences of one micro-batch); make it even")
    if d.label_smoothing and d.loss != "robust":
        raise ValueError(f"dpo.label_smoothing: {d.label_smoothing:g} would do nothing to dpo.loss="
                         f"{d.loss} (as in TRL, only robust DPO takes it); use dpo.loss=robust, or leave it 0")
    if d.precompute_ref and not d.uses_reference:
        raise ValueError(f"dpo.precompute_ref: dpo.loss={d.loss} has no reference model to precompute")


@dataclass(frozen=True)
class Registered:
    """A built-in objective: its class (`module:Class`), and the checks its options take
    before anything starts (no torch)."""

    path: str
    check: Callable | None = None
    summary: str = ""  # one line for `train.objective`'s description


# The built-in objectives, by `train.objective`'s value: one line each.
OBJECTIVES = {
    "lm": Registered("rayzero.objectives.next_token:NextToken",
                     summary="next-token prediction on text or instruction data"),
    "dpo": Registered("rayzero.objectives.dpo:DPO", check_dpo,
                      summary="preference tuning on pairs (data prepared with `--preferences`; the loss in `dpo`); "
                              "batch sizes count sequences: a pair is two, its chosen and rejected always in one "
                              "micro-batch"),
}


def is_path(name: str) -> bool:
    """Whether `train.objective` names a user's class (`package.module:Class`) rather than a built-in."""
    return ":" in name


def check_name(name: str) -> str:
    """`train.objective`'s value, refused unless a built-in's name or `package.module:Class`."""
    if name in OBJECTIVES:
        return name
    module, sep, attr = name.partition(":")
    if sep and module and attr:
        return name
    raise ValueError(f"expected {', '.join(OBJECTIVES)} or package.module:Class (an Objective of your own)")


def check_options(cfg) -> None:
    """The built-in objective's checks of the config (a user's own runs `Objective.check` when
    it is imported, before the cluster starts)."""
    entry = OBJECTIVES.get(cfg.train.objective)
    if entry is not None and cfg.train.objective_kwargs:
        raise ValueError(f"train.objective_kwargs: for an objective of your own (train.objective=package.module:Class); "
                         f"train.objective={cfg.train.objective} takes none")
    if entry is not None and entry.check is not None:
        entry.check(cfg)
