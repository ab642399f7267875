from typing import Literal

from pydantic import Field

from rayzero._frozen import Frozen
from rayzero.checkpoint.records import brief, first_difference, stored

# The losses that compare the policy with a reference model; `orpo` needs none.
REFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust")


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
        return self.loss in REFERENCE_LOSSES


# A fine-tune's learning rate when `optim.lr` is left unset (`jobs/defaults.py`): TRL's SFTConfig and DPOConfig
# defaults for full fine-tuning, and for LoRA about ten times that, as TRL's PEFT guide advises.
FINE_TUNING_LR = {"lm": (2e-5, 2e-4), "dpo": (1e-6, 1e-5)}


def fine_tuning_lr(objective: str, lora: bool) -> float:
    """The learning rate a fine-tune of `objective` takes by default (full, or LoRA)."""
    return FINE_TUNING_LR[objective][int(lora)]


def objective_record(cfg, model: dict | None) -> dict:
    """What a checkpoint notes of the objective it was trained for: its name and, for a loss
    with a reference model, which reference (how it is made, and from what model, `model`:
    `ModelSpec.record()`). The reference is rebuilt from `model.path` on a resume, never stored.
    In the form the manifest stores it (`records.stored`): the record a run writes and the one
    the same command computes again compare equal."""
    if cfg.train.objective != "dpo":
        return {"name": "lm"}
    reference = None
    if cfg.dpo.uses_reference:
        reference = _reference("adapters_off" if cfg.model.lora is not None else "frozen_copy", model)
    return stored({"name": "dpo", "loss": cfg.dpo.loss, "reference": reference})


def _reference(kind: str, model: dict | None) -> dict:
    """A reference model's record: with LoRA (`adapters_off`) the base model, whatever the
    adapters' settings (they are not part of it); else the model the policy starts as."""
    if kind == "adapters_off" and model is not None:
        model = {k: v for k, v in model.items() if k != "lora"}
    return {"kind": kind, "model": model}


# The two ways out of a refusal to resume, as every such refusal gives them.
WAYS_OUT = "train into another checkpoint.dir, or set checkpoint.resume=none to start from scratch beside them"


def objective_difference(saved: dict | None, now: dict) -> str | None:
    """Why a checkpoint (its `objective` record; None: from before objectives were recorded,
    i.e. `lm`) cannot be resumed by a run of objective `now`, or None: the first field of the
    records that differs, with its two values, and the ways out."""
    saved = stored(saved or {"name": "lm"})
    if saved.get("name") != now["name"]:
        return (f"it was trained with train.objective={saved.get('name')}, this run has train.objective={now['name']}; "
                + ("to tune its result on preferences, export it (train.save_final) and start from it with "
                   "model.path, or " if now["name"] == "dpo" else "")
                + WAYS_OUT)
    was, here = (r and _reference(r["kind"], r.get("model")) for r in (saved.get("reference"), now.get("reference")))
    found = first_difference(was, here, "reference")
    if found is None:
        return None

    def said(r):
        return "none" if not r else f"{r['kind']} of {(r.get('model') or {}).get('source') or 'its model'}"

    field = (f"{found[0]} is {brief(found[1])} in the checkpoint, {brief(found[2])} here; "
             if was and here else "")  # else the kinds say it: one is none
    return (f"its reference model ({said(was)}) is not this run's ({said(here)}): {field}the rewards would be "
            f"measured against another model; {WAYS_OUT}")


def objective_plan(cfg, params_per_rank: int | None, frozen_bytes_per_param: float, param_dtype: str) -> dict | None:
    """What `--dry-run` says of preference tuning (None: `lm`): the loss, and the reference
    model's bytes per rank, in the compute dtype and sharded as frozen parameters are (a frozen
    copy: its parameters x `frozen_bytes_per_param`; none for LoRA, whose reference is the base
    with the adapters off, a reference-free loss, or a precomputed reference, which holds it only
    for the pass before training)."""
    if cfg.train.objective != "dpo":
        return None
    d = cfg.dpo
    if not d.uses_reference:
        how, held = "none (reference-free)", 0
    elif cfg.model.lora is not None:
        how, held = "the base model with the LoRA adapters off (no copy)", 0
    else:
        how = f"a frozen copy of the starting weights in {param_dtype}, sharded like the policy"
        held = int(frozen_bytes_per_param * params_per_rank) if params_per_rank else None
    before = held if d.precompute_ref else 0
    return {"loss": d.loss, "beta": d.beta, "reference": how, "precompute_ref": d.precompute_ref,
            "reference_bytes": 0 if d.precompute_ref else held, "reference_bytes_before_training": before}


def objective_line(o: dict) -> str:
    """The dry run's line for `objective_plan`."""
    mib = (lambda b: f"{b / 2**20:,.1f} MiB per rank" if b is not None else "its size unknown here")
    ref = o["reference"]
    if o["precompute_ref"]:
        ref += f"; its log-probabilities precomputed before training ({mib(o['reference_bytes_before_training'])} " \
               "then), then dropped"
    elif o["reference_bytes"]:
        ref += f": {mib(o['reference_bytes'])} beside the model state (no gradient, main copy or optimizer state)"
    return f"objective dpo, loss {o['loss']} (beta {o['beta']:g}); reference: {ref}"
