"""docs/reference/configuration.md: generated from the config classes, and in step with them."""

import functools
import re
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field, SecretStr

from rayzero import config_reference as ref
from rayzero.config import ConfigError, RootConfig, load_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "configuration.md"


@functools.cache
def table() -> dict[str, dict[str, str]]:
    """The reference's rows as users read them: key -> {type, default, meaning, wrong} (cell text)."""
    out = {}
    for line in ref.render().splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        key, typ, default, meaning, wrong = cells
        assert key not in out, f"{key} listed twice"
        out[key.strip("`")] = {"type": typ, "default": default, "meaning": meaning, "wrong": wrong}
    return out


def all_fields(model: type[BaseModel], prefix: str):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from all_fields(ann, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", field


def test_committed_reference_is_up_to_date():
    assert DOC.is_file(), "docs/reference/configuration.md is missing: run python -m rayzero.config_reference"
    assert DOC.read_text() == ref.render(), (
        "docs/reference/configuration.md is out of date: run python -m rayzero.config_reference"
    )


def test_every_field_and_section_is_described():
    missing = []
    for section, info in RootConfig.model_fields.items():
        model = info.annotation
        if not (model.__dict__.get("__doc__") or "").strip():
            missing.append(f"{section} (class {model.__name__} has no docstring)")
        missing += [key for key, f in all_fields(model, section) if not (f.description or "").strip()]
    assert not missing, f"without a description: {', '.join(missing)}"
    assert all(row["meaning"] for row in table().values())


def test_keys_are_the_dotted_keys_users_type():
    keys = list(table())
    assert keys == list(RootConfig().flat())  # aliases applied, RootConfig and class order
    assert "checkpoint.async" in keys and "checkpoint.async_" not in keys
    sections = [line.removeprefix("## ") for line in ref.render().splitlines() if line.startswith("## ")]
    assert sections == list(RootConfig.model_fields)


def override_text(default_cell: str) -> str | None:
    """The default cell as the value of a `key=value` override, or None where it is not one."""
    if not (default_cell.startswith("`") and default_cell.endswith("`")):
        return None
    text = default_cell[1:-1]
    return "" if text == '""' else text


@pytest.mark.parametrize("key", list(RootConfig().flat()))
def test_every_default_round_trips_as_an_override(key):
    row = table()[key]
    value = override_text(row["default"])
    assert value is not None, f"{key}: default {row['default']!r} is not an override value"
    assert load_config(None, [f"{key}={value}"]) == RootConfig(), f"{key}={value} is not the default"


def test_secret_default_is_never_shown():
    row = table()["checkpoint.s3_secret_access_key"]
    assert row["default"] == '`""`' and "secret" in row["type"]

    class WithSecret(BaseModel):
        token: SecretStr = Field(default=SecretStr("hunter2"), description="An access token.")

    (r,) = ref.rows(WithSecret, "auth")
    assert "hunter2" not in r.default + r.type + r.meaning
    assert r.default == "(hidden)"


def test_types_and_defaults_read_as_users_write_them():
    rows = table()
    assert rows["train.steps"]["type"] == "`int`, >= 1"
    assert rows["optim.beta1"]["type"] == "`float`, >= 0, < 1"
    assert rows["cluster.min_workers"]["type"] == "`int | None`, >= 1"
    assert rows["cluster.backend"]["type"] == "one of `auto`, `gloo`, `nccl`"
    assert rows["sharding.comm_dtype"]["type"] == "one of `fp32`, `bf16`, `fp16`; or `null`"
    assert rows["cluster.min_workers"]["default"] == "`null`"
    assert rows["cluster.use_gpu"]["default"] == "`false`"
    assert rows["cluster.address"]["default"] == '`""`'
    assert rows["sharding.fsdp_units"]["default"] == '`""`'  # empty: the model's own units

    class Inner(BaseModel):
        """Nested."""

        name: str | None = Field(default=None, description="A name.")

    class Outer(BaseModel):
        inner: Inner = Inner()
        mode: Literal["a", "b"] = Field(default="a", description="A mode.")

    rows = ref.rows(Outer, "outer")
    assert [(r.key, r.type, r.default) for r in rows] == [
        ("outer.inner.name", "`str | None`", "null"),
        ("outer.mode", "one of `a`, `b`", "a"),
    ]


def test_check_reports_a_stale_file_and_write_fixes_it(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    assert ref.main(["--check", str(path)]) == 1
    path.write_text("# stale\n")
    assert ref.main(["--check", str(path)]) == 1
    assert f"{path} is out of date: run python -m rayzero.config_reference" in capsys.readouterr().err
    assert ref.main([str(path)]) == 0
    assert path.read_text() == ref.render()
    assert ref.main(["--check", str(path)]) == 0


def test_rename_leaves_the_train_key():
    from rayzero.config import RunConfig

    assert RootConfig.model_fields["train"].annotation is RunConfig
    assert load_config(None, ["train.steps=5"]).train == RunConfig(steps=5)


def test_unknown_key_suggestions_use_the_keys_users_type():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["checkpoint.asyn=false"])
    assert "did you mean 'async'?" in str(info.value) and "async_" not in str(info.value)


def test_a_wrong_value_shows_the_message_the_key_gets():
    """Where a key's type rules values out, the reference shows one and what `load_config` says
    to it: the message is the real one (asked when the reference is written), and it names the key."""
    rows = table()
    shown = {key: row["wrong"] for key, row in rows.items() if row["wrong"]}
    assert len(shown) > 0.7 * len(rows), sorted(set(rows) - set(shown))
    for key, cell in shown.items():
        value, said = re.fullmatch(r"`(\S+?)` → (.+)", cell).groups()
        assert value.startswith(f"{key}=") and said.startswith(key), cell
        with pytest.raises(ConfigError) as e:
            load_config(None, [value])
        assert said.split(";")[0].replace("\\|", "|") in str(e.value), (cell, str(e.value))
    assert shown["train.steps"].startswith("`train.steps=0` → train.steps: Input should be greater than or equal to 1")
    assert "expected none, full, every:N" in shown["model.activation_checkpointing"]


def test_a_wrong_value_that_is_accepted_fails_the_reference():
    row = ref.Row("train.steps", "`int`", "100", "Steps.", wrong="50")
    with pytest.raises(AssertionError, match="train.steps=50 is accepted"):
        ref.refusal(row)
