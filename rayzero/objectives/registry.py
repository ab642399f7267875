"""The run's objective made from its config (`objective_for`): a built-in one by name
(`config.OBJECTIVES`), a user's class remembered (given from Python, or sent to a rank by the
driver) or imported from `package.module:Class`; and what a checkpoint records of it, as a resume
compares it."""

from __future__ import annotations

from rayzero._imports import import_path
from rayzero.checkpoint.records import brief, first_difference, stored
from rayzero.objectives.base import DATA_KINDS, Objective
from rayzero.objectives.config import OBJECTIVES

_given: dict[str, type] = {}  # a user's class given from Python, or sent to a rank: by its name


def remember(name: str, cls: type) -> None:
    """`cls` is what `train.objective=name` means in this process (a class from a notebook, or
    one the driver sent to a rank by value)."""
    _given[name] = cls


def objective_class(name: str) -> type:
    """The class `train.objective=name` trains: a built-in's, a remembered one, or imported from
    `package.module:Class`; ValueError saying what is wrong with a user's."""
    if name in _given:
        return _given[name]
    path = OBJECTIVES[name].path if name in OBJECTIVES else name
    return check_class(import_path(path, "train.objective", "package.module:Class"), name)


def check_class(obj, name: str) -> type:
    """`obj` if it is an `Objective` subclass that provides a loss; else ValueError in one line."""
    if not isinstance(obj, type) or not issubclass(obj, Objective):
        raise ValueError(f"train.objective: {name} is a {type(obj).__name__}, not a subclass of "
                         "rayzero.objectives.Objective")
    if obj.loss is Objective.loss and obj.rank_side is Objective.rank_side:
        raise ValueError(f"train.objective: {name} defines no loss(self, out, batch) (see the objectives guide)")
    ref = getattr(obj, "reference", "none")
    if isinstance(ref, str) and ref not in ("none", "frozen_copy", "adapters_off"):
        raise ValueError(f"train.objective: {name}.reference is {ref!r}; an objective's reference model is none, "
                         "frozen_copy or adapters_off")
    odd = [k for k in obj.data_kinds if k not in DATA_KINDS]
    if odd:
        raise ValueError(f"train.objective: {name}.data_kinds names {', '.join(map(repr, odd))}; the kinds of "
                         f"prepared data are {', '.join(DATA_KINDS)}")
    return obj


def objective_for(cfg):
    """The run's objective (`Objective`), made from its config."""
    name = cfg.train.objective
    cls = objective_class(name)
    try:
        made = cls(cfg, **cfg.train.objective_kwargs)
    except TypeError as e:
        raise ValueError(f"train.objective_kwargs: {name}({', '.join(cfg.train.objective_kwargs) or 'cfg'}) "
                         f"failed: {e}") from None
    made.name = name
    return made


# -- what a checkpoint records --------------------------------------------------------------------
def objective_record(cfg, model: dict | None) -> dict:
    """What a checkpoint notes of the objective it was trained for: its name and, for a loss
    with a reference model, which reference (how it is made, and from what model, `model`:
    `ModelSpec.record()`). The reference is rebuilt from `model.path` on a resume, never stored.
    In the form the manifest stores it (`records.stored`): the record a run writes and the one
    the same command computes again compare equal."""
    return stored(objective_for(cfg).record(model))


def reference_record(kind: str, model: dict | None) -> dict:
    """A reference model's record: with LoRA (`adapters_off`) the base model, whatever the
    adapters' settings (they are not part of it); else the model the policy starts as."""
    if kind == "adapters_off" and model is not None:
        model = {k: v for k, v in model.items() if k != "lora"}
    return {"kind": kind, "model": model}


# The two ways out of a refusal to resume, as every such refusal gives them.
WAYS_OUT = "train into another checkpoint.dir, or set checkpoint.resume=none to start from scratch beside them"


def objective_difference(saved: dict | None, now: dict, hint: str = "") -> str | None:
    """Why a checkpoint (its `objective` record; None: from before objectives were recorded,
    i.e. `lm`) cannot be resumed by a run of objective `now`, or None: the first field of the
    records that differs, with its two values, and the ways out (`hint`: the objective's own
    way, said first)."""
    saved = stored(saved or {"name": "lm"})
    if saved.get("name") != now["name"]:
        return (f"it was trained with train.objective={saved.get('name')}, this run has train.objective={now['name']}; "
                + (f"{hint}, or " if hint else "") + WAYS_OUT)
    was, here = (r and reference_record(r["kind"], r.get("model")) for r in (saved.get("reference"), now.get("reference")))
    found = first_difference(was, here, "reference")
    if found is None:
        # what the objective says must hold for a resume (`Objective.record`'s "checked")
        found = first_difference(saved.get("checked"), now.get("checked"), "checked")
        if found is None:
            return None
        return (f"its objective's {found[0].removeprefix('checked.')} is {brief(found[1])} in the checkpoint, "
                f"{brief(found[2])} here; {WAYS_OUT}")

    def said(r):
        return "none" if not r else f"{r['kind']} of {(r.get('model') or {}).get('source') or 'its model'}"

    field = (f"{found[0]} is {brief(found[1])} in the checkpoint, {brief(found[2])} here; "
             if was and here else "")  # else the kinds say it: one is none
    return (f"its reference model ({said(was)}) is not this run's ({said(here)}): {field}the rewards would be "
            f"measured against another model; {WAYS_OUT}")
