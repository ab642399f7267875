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
ARCHITECTURE = DOC.parents[1] / "concepts" / "architecture.md"
CONFIGURING = DOC.parents[1] / "guides" / "configuring.md"


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
    assert sections == [ref.FIT_HEADING, *RootConfig.model_fields]


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


# The world size and the data-parallel size as the mesh makes them, in the keys users set.
WORLD = ("`cluster.num_workers` = `parallel.pp` × `sharding.dp_outer` × shards × `parallel.ep` × `parallel.cp` × "
         "`parallel.tp`")
DP_OF_WORLD = "`cluster.num_workers` / (`parallel.pp` × `parallel.cp` × `parallel.tp`)"
DP = f"data-parallel size = `sharding.dp_outer` × shards × `parallel.ep` = {DP_OF_WORLD}"


def test_the_reference_states_the_world_size_and_the_batch_rule_from_the_mesh():
    """The formulas are written from the mesh's tables (its axes, its `batch` role), which its
    checks read; the reference and the architecture page say the same ones."""
    assert (ref.world_formula(), ref.dp_formula()) == (WORLD, DP)
    text = DOC.read_text()
    for said in (WORLD, DP, ref.BATCH_RULE):
        assert said in text
    assert WORLD in ARCHITECTURE.read_text() and DP in ARCHITECTURE.read_text()
    assert DP_OF_WORLD in " ".join(CONFIGURING.read_text().split())
    assert DP_OF_WORLD.replace("×", "x") in table()["train.global_batch_size"]["meaning"]


@pytest.mark.parametrize("axis", ["tp", "cp", "pp"])
def test_the_batch_check_refuses_by_the_rule_the_reference_states(axis):
    """At 4 ranks and `parallel.<axis>=2` the data-parallel size is 4 / 2: the global batch must
    divide by micro batch x 2, not micro batch x 4 ranks, and the check's message says that rule."""
    base = ["cluster.num_workers=4", f"parallel.{axis}=2", "train.micro_batch_size=4"]
    assert load_config(None, [*base, "train.global_batch_size=8"]).grad_accum == 1  # 8 is not 4 x 4 ranks
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "train.global_batch_size=4"])
    said = str(e.value)
    assert "train.global_batch_size: 4 is not divisible by train.micro_batch_size (4) x data-parallel size (2) = 8" \
        in said
    rule = re.fullmatch(r"`(\S+)` must be divisible by `(\S+)` × the data-parallel size", ref.BATCH_RULE)
    batch, micro = rule.groups()
    assert re.search(rf"{batch}: \d+ is not divisible by {micro} \(\d+\) x data-parallel size \(2\)", said)


def test_the_world_check_refuses_by_the_formula_the_reference_states():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["cluster.num_workers=6", "parallel.tp=4"])
    said = str(e.value)
    assert "parallel.tp: 4 does not divide cluster.num_workers (6)" in said
    groups = re.search(r"the ranks form (.+) groups", said).group(1)  # pp x replicate (dp_outer) x shard x ...
    factors = [f.strip("`").rpartition(".")[2] for f in WORLD.split(" = ")[1].split(" × ")]  # pp, dp_outer, shards
    assert [g.split(" (")[-1].rstrip(")") for g in groups.split(" x ")] == [f.removesuffix("s") for f in factors]
    with pytest.raises(ConfigError, match=r"parallel.pp x sharding.dp_outer x parallel.tp: 2 x 3 x 2 = 12 does not"):
        load_config(None, ["cluster.num_workers=8", "parallel.pp=2", "sharding.dp_outer=3", "parallel.tp=2"])


def test_the_reference_shows_the_refusals_as_the_checks_word_them():
    text = ref.render()
    for overrides in ref.REFUSED:
        with pytest.raises(ConfigError) as e:
            load_config(None, list(overrides))
        assert f"- `{' '.join(overrides)}` → {str(e.value).splitlines()[1].strip()}" in text
    assert {o.split("=")[0] for o in ref.REFUSED[0] + ref.REFUSED[1]} >= {"parallel.tp", "parallel.cp"}
