"""The configuration reference, generated from the config classes themselves.

    python -m rayzero.config_reference            # (re)write docs/reference/configuration.md
    python -m rayzero.config_reference --check    # exit 1 if it is out of date

Every key, its type, its default and its description come from `RootConfig`'s sections, so the
reference cannot drift from what `load_config` accepts; and where a key's type rules values out
(a bound, a set of choices, a number or a flag), the message `load_config` gives one of them,
asked of `load_config` itself when the reference is written. How the sizes fit together (the
world size, the data-parallel size, the batch rule) is written from the mesh's own tables, the
ones its checks read, with the messages those checks give.
"""

from __future__ import annotations

import argparse
import collections.abc
import enum
import inspect
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel, SecretBytes, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rayzero.config import ConfigError, RootConfig, load_config
from rayzero.sharding.mesh import AXES, ROLES

DEFAULT_PATH = "docs/reference/configuration.md"
REGENERATE = "python -m rayzero.config_reference"

TITLE = "# Configuration reference"
INTRO = (
    "A job is configured by an optional YAML file of the sections below plus `key=value` overrides "
    "on the command line, which win over the file, e.g. "
    "`rayzero train --config job.yaml train.steps=50`. Every key is optional; an unknown key or an "
    "invalid value is an error that names the key, reported before any cluster is touched. In an "
    "override, `null` means unset and a list is written comma-separated."
)
NOTE = f"<!-- Generated from the config classes by `{REGENERATE}`; do not edit by hand. -->"


@dataclass(frozen=True)
class Row:
    """One key of the reference, as the table shows it."""

    key: str  # the dotted key users type, aliases applied
    type: str
    default: str  # as users would type it in an override (`""` for an empty string)
    meaning: str
    secret: bool = False
    wrong: str = ""  # a value the key refuses, as typed in an override ("" where its type takes any text)


def sections() -> list[tuple[str, type[BaseModel]]]:
    """`RootConfig`'s sections in class order: (key, model class)."""
    return [(_name(n, f), _model_of(f.annotation)) for n, f in RootConfig.model_fields.items()]


def rows(model: type[BaseModel], prefix: str) -> list[Row]:
    """Every key of `model`, in class order, nested models recursed into."""
    out: list[Row] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{_name(name, field)}"
        nested = _model_of(field.annotation)
        if nested is not None:
            out.extend(rows(nested, key))
            continue
        optional = _optional_section(field.annotation)
        if optional is not None:  # a section that is off by default (model.lora): its keys in the meaning
            keys = "; ".join(f"`{r.key}` ({r.type}, default `{r.default}`): {r.meaning.rstrip('.')}" for r in rows(optional, key))
            out.append(Row(key, "a section, or `null`", render_default(field),
                           _clean(field.description or "") + f" Its keys: {keys}."))
            continue
        out.append(Row(key, render_type(field), render_default(field), _clean(field.description or ""),
                       secret=_is_secret(field.annotation), wrong=WRONG.get(key) or wrong_value(field)))
    return out


def _optional_section(tp: Any) -> type[BaseModel] | None:
    """`Model | None` -> Model."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    return _model_of(members[0]) if len(members) == 1 else None


def render() -> str:
    parts = [TITLE, "", NOTE, "", INTRO, ""]
    contents = ", ".join(f"[`{name}`](#{name})" for name, _ in sections())
    parts += [f"Sections: [{FIT_HEADING.lower()}](#{FIT_ANCHOR}) (how the sizes fit together), then {contents}.", ""]
    parts += fit()
    for name, model in sections():
        parts += [f"## {name}", ""]
        doc = _docstring(model)
        if doc:
            parts += [doc, ""]
        parts += ["| key | type | default | meaning | a wrong value gets |", "| --- | --- | --- | --- | --- |"]
        for r in rows(model, name):
            cells = [f"`{r.key}`", r.type, f"`{r.default}`" if r.default else "", r.meaning, refusal(r)]
            parts.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("")
    return "\n".join(parts)


# --------------------------------------------------------------------------- how the sizes fit

FIT_HEADING = "The world size and the batch"
FIT_ANCHOR = FIT_HEADING.lower().replace(" ", "-")
SHARDS = "shards"  # the mesh's `shard` axis: no key sets it, it takes the ranks the others leave
BATCH_RULE = "`train.global_batch_size` must be divisible by `train.micro_batch_size` × the data-parallel size"
# Runs the checks refuse, shown with their messages: a batch at tp 2 and at cp 2, and a world that does not divide.
REFUSED = (("cluster.num_workers=4", "parallel.tp=2", "train.global_batch_size=4"),
           ("cluster.num_workers=4", "parallel.cp=2", "train.global_batch_size=4"),
           ("cluster.num_workers=6", "parallel.tp=4"))
EXAMPLE = ("cluster.num_workers=8", "parallel.tp=2", "parallel.pp=2", "train.global_batch_size=16",
           "train.micro_batch_size=4")


def _factor(axis: str) -> str:
    key = AXES[axis]
    return f"`{key}`" if key else SHARDS


def world_formula() -> str:
    """The world size as the mesh divides it: its axes, outermost first (`mesh.AXES`), by the keys
    that set them."""
    return "`cluster.num_workers` = " + " × ".join(_factor(a) for a in AXES)


def set_sizes() -> str:
    """The product of the axes a key sets, which must divide the world (the rest is shards)."""
    return " × ".join(_factor(a) for a in AXES if AXES[a])


def dp_formula() -> str:
    """The data-parallel size, the mesh's `batch` role (`mesh.ROLES`): the ranks the global batch
    splits over, and the world divided by the axes that share one part of it."""
    batch = ROLES["batch"]
    shared = [a for a in AXES if a not in batch]
    return ("data-parallel size = " + " × ".join(_factor(a) for a in batch)
            + " = `cluster.num_workers` / (" + " × ".join(_factor(a) for a in shared) + ")")


def fit() -> list[str]:
    """The section on how `cluster.num_workers`, `parallel.*`, `sharding.dp_outer` and the batch
    sizes fit together, its figures and messages asked of the config itself."""
    cfg = load_config(None, list(EXAMPLE))
    dp, accum = cfg.mesh().size("batch"), cfg.grad_accum
    example = " ".join(EXAMPLE)
    parts = [f"## {FIT_HEADING}", "",
             "The ranks form a mesh whose axes, outermost first, multiply to the world size:", "",
             f"**{world_formula()}**", "",
             f"No key sets {SHARDS}: it is what the other factors leave, so {set_sizes()} must divide "
             "`cluster.num_workers`.", "",
             "The global batch splits over the data-parallel ranks:", "",
             f"**{dp_formula()}**", "",
             "The ranks of a tensor-parallel group, of a context-parallel group and a pipeline's stages share "
             "one part of the batch; the ranks of an expert-parallel group take different rows.", "",
             f"**{BATCH_RULE}**; each data-parallel rank then runs `train.global_batch_size` / "
             "(`train.micro_batch_size` × data-parallel size) micro-batches a step, their gradients accumulated. "
             f"For example, `{example}` gives a data-parallel size of {dp} and {accum} micro-batches per rank per "
             "step.", "",
             "A run that breaks a rule is refused before anything starts:", ""]
    for overrides in REFUSED:
        said = said_to(overrides)
        if said is None:
            raise AssertionError(f"{' '.join(overrides)} is accepted: the reference's refused run is not refused")
        parts.append(f"- `{' '.join(overrides)}` → {said}")
    return parts + [""]


# --------------------------------------------------------------------------- types


def render_type(field: FieldInfo) -> str:
    text = _type(field.annotation)
    bounds = [_bound(m) for m in field.metadata]
    bounds = [b for b in bounds if b]
    return ", ".join([text, *bounds])


def _type(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{_value(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        nullable = len(members) < len(args)
        literals = [v for a in members if typing.get_origin(a) is Literal for v in typing.get_args(a)]
        others = [a for a in members if typing.get_origin(a) is not Literal]
        if literals:
            alts = [f"{_article(_type(a))} {_type(a)}" for a in others] + (["`null`"] if nullable else [])
            text = "one of " + ", ".join(f"`{_value(v)}`" for v in literals)
            return text + ("; or " + " or ".join(alts) if alts else "")
        names = [_name_of(a) for a in others] + (["None"] if nullable else [])
        return f"`{' | '.join(names)}`"
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence):
        item = args[0] if args else Any
        return f"list of {_type(item)}"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}" if args else "mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in tp)
    if _is_secret(tp):
        return "`str` (secret)"
    return f"`{_name_of(tp)}`"


def _name_of(tp: Any) -> str:
    if tp is Any:
        return "any"
    if isinstance(tp, type):
        if issubclass(tp, Path):
            return "str"
        if _is_secret(tp):
            return "str"
        return tp.__name__
    return str(tp).replace("typing.", "")


def _article(text: str) -> str:
    return "an" if text.strip("`").lower()[:1] in ("a", "e", "i", "o", "u") else "a"


def _bound(m: Any) -> str:
    for cls, op in ((at.Ge, ">="), (at.Gt, ">"), (at.Le, "<="), (at.Lt, "<")):
        if isinstance(m, cls):
            return f"{op} {_value(getattr(m, cls.__name__.lower()))}"
    if isinstance(m, at.MultipleOf):
        return f"multiple of {_value(m.multiple_of)}"
    if isinstance(m, at.MinLen):
        return f"at least {m.min_length} long"
    if isinstance(m, at.MaxLen):
        return f"at most {m.max_length} long"
    return ""


# --------------------------------------------------------------------------- wrong values

# Keys whose type takes text that a validator of their own then reads: a value it refuses.
WRONG = {"model.activation_checkpointing": "sometimes", "sharding.bucket_numel": "lots",
         "sharding.loss_scale": "lots", "parallel.pp_layers": "two"}


def wrong_value(field: FieldInfo) -> str:
    """A value `field` refuses by its type alone, as typed in an override: one past a bound, a
    choice that is not one, a word for a number or a flag; "" where the type takes any text
    (paths, names, patterns: those are checked against what they name, when a run starts)."""
    tp = field.annotation
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if all(typing.get_origin(a) is Literal for a in members):
            return "nosuch"
        if len(members) != 1:
            return ""
        tp = members[0]
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is Literal or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        return "nosuch"
    if tp is bool:
        return "maybe"
    if tp in (int, float):
        for m in field.metadata:
            for cls, step in ((at.Ge, -1), (at.Gt, 0), (at.Le, 1), (at.Lt, 0)):
                if isinstance(m, cls):
                    return _value(getattr(m, cls.__name__.lower()) + step)
        return "many"
    return ""


def refusal(row: Row) -> str:
    """What `load_config` says to `row.key=row.wrong`: the reference shows the real message."""
    if not row.wrong:
        return ""
    said = said_to([f"{row.key}={row.wrong}"])
    if said is None:
        raise AssertionError(f"{row.key}={row.wrong} is accepted: the reference's wrong value is not wrong")
    return f"`{row.key}={row.wrong}` → {said}"


def said_to(overrides: list[str] | tuple[str, ...]) -> str | None:
    """What `load_config` says to `overrides`, its lines joined on one (None: it accepts them)."""
    try:
        load_config(None, list(overrides))
    except ConfigError as e:
        return "; ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip())
    return None


# --------------------------------------------------------------------------- defaults


def render_default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return ""  # required
    value = field.get_default(call_default_factory=True)
    if _is_secret(field.annotation) or isinstance(value, (SecretStr, SecretBytes)):
        # Never a secret's value: an empty one reads as empty, anything else as hidden.
        return '""' if not _secret_value(value) else "(hidden)"
    return _value(value)


def _value(v: Any) -> str:
    """`v` as it is written in an override."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, enum.Enum):
        return _value(v.value)
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, (list, tuple, set, frozenset)):
        return ",".join(_value(x) for x in v) if v else '""'
    if isinstance(v, BaseModel):
        return ""
    return repr(v) if isinstance(v, float) else str(v)


def _secret_value(v: Any) -> Any:
    return v.get_secret_value() if isinstance(v, (SecretStr, SecretBytes)) else v


def _is_secret(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_secret(a) for a in typing.get_args(tp))
    return isinstance(tp, type) and issubclass(tp, (SecretStr, SecretBytes))


# --------------------------------------------------------------------------- helpers


def _name(name: str, field: FieldInfo) -> str:
    """The key users type: the field's alias where it has one."""
    return field.validation_alias if isinstance(field.validation_alias, str) else (field.alias or name)


def _model_of(tp: Any) -> type[BaseModel] | None:
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _docstring(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    return _clean(inspect.cleandoc(doc)) if doc else ""


def _clean(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# --------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    return page_command(argv, "rayzero.config_reference", "the configuration reference generated from the config "
                        "classes", DEFAULT_PATH, render)


def page_command(argv: list[str] | None, module: str, what: str, default_path: str, render_page) -> int:
    """`python -m MODULE [--check] [PATH]` for a page generated from the code: write it, or with
    `--check` exit 1 (saying the command that renews it) where PATH differs from what it renders."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=f"Write {what}.")
    p.add_argument("--check", action="store_true", help="exit 1 if PATH differs from the generated text")
    p.add_argument("path", nargs="?", default=default_path, help=f"where it goes (default: {default_path})")
    args = p.parse_args(argv)
    path, text = Path(args.path), render_page()
    how = f"python -m {module}" + ("" if args.path == default_path else f" {args.path}")
    if args.check:
        if not path.is_file():
            print(f"{args.path} does not exist: run {how}", file=sys.stderr)
            return 1
        if path.read_text() != text:
            print(f"{args.path} is out of date: run {how}", file=sys.stderr)
            return 1
        print(f"{args.path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
