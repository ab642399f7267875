"""Loading the job config: YAML file + key=value overrides, and the errors a user sees."""

from pathlib import Path

import pydantic
import pytest

from rayzero.cluster.config import ClusterConfig, TrackingConfig
from rayzero.config import ConfigError, RootConfig, RunConfig, load_config
from rayzero.data.config import DataConfig
from rayzero.models.gpt import PRESETS, ModelConfig
from rayzero.sharding.config import OptimConfig, ShardingConfig


def write(tmp_path, text: str, name: str = "job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


# --------------------------------------------------------------------------- loading


def test_defaults_load_without_a_file():
    cfg = load_config()
    assert isinstance(cfg, RootConfig)
    assert cfg.train == RunConfig()
    assert cfg.optim == OptimConfig()
    assert cfg.sharding == ShardingConfig()
    assert cfg.cluster == ClusterConfig()
    assert cfg.tracking == TrackingConfig()
    assert cfg.data == DataConfig()
    # the default preset fills the model's dimensions
    assert cfg.model.preset == "tiny"
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (
        PRESETS["tiny"]["n_layer"], PRESETS["tiny"]["n_head"], PRESETS["tiny"]["n_embd"],
    )
    assert load_config(None, []) == cfg


def test_empty_yaml_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == load_config()
    assert load_config(str(write(tmp_path, "# nothing\n", "c.yaml"))) == load_config()


def test_yaml_file_sets_values_and_overrides_win(tmp_path):
    path = write(
        tmp_path,
        "train:\n  steps: 7\n  seq_len: 64\noptim:\n  lr: 0.01\nsharding:\n  strategy: no_shard\n",
    )
    cfg = load_config(path)
    assert cfg.train.steps == 7 and cfg.train.seq_len == 64
    assert cfg.optim.lr == 0.01
    assert cfg.sharding.strategy == "no_shard"
    assert cfg.train.global_batch_size == RunConfig().global_batch_size  # untouched keys keep defaults

    cfg = load_config(path, ["train.steps=50", "sharding.strategy=optim"])
    assert cfg.train.steps == 50 and cfg.sharding.strategy == "optim"
    assert cfg.train.seq_len == 64  # file values not overridden stay


def test_later_override_wins_over_earlier_one():
    assert load_config(None, ["train.steps=3", "train.steps=9"]).train.steps == 9


def test_override_value_may_contain_equals_and_spaces_around_key():
    cfg = load_config(None, ["tracking.run_name=a=b", " train.steps = 12"])
    assert cfg.tracking.run_name == "a=b"
    assert cfg.train.steps == 12


def test_empty_override_value_is_an_empty_string():
    assert load_config(None, ["train.save_final=out.st", "train.save_final="]).train.save_final == ""


@pytest.mark.parametrize(
    "override, section, key, expected",
    [
        ("optim.lr=1e-3", "optim", "lr", 1e-3),
        ("optim.lr=3E-4", "optim", "lr", 3e-4),
        ("optim.lr=0.02", "optim", "lr", 0.02),
        ("optim.weight_decay=0", "optim", "weight_decay", 0.0),
        ("cluster.cpus_per_worker=0.5", "cluster", "cpus_per_worker", 0.5),
        ("cluster.use_gpu=true", "cluster", "use_gpu", True),
        ("cluster.use_gpu=false", "cluster", "use_gpu", False),
        ("tracking.enabled=False", "tracking", "enabled", False),
        ("sharding.overlap_grad_reduce=false", "sharding", "overlap_grad_reduce", False),
        ("train.steps=250", "train", "steps", 250),
        ("sharding.bucket_numel=1024", "sharding", "bucket_numel", 1024),
        ("train.output_dir=/tmp/runs", "train", "output_dir", "/tmp/runs"),
        ("cluster.address=auto", "cluster", "address", "auto"),
        ("cluster.dispatch=chained", "cluster", "dispatch", "chained"),
        ("cluster.dispatch=pipelined", "cluster", "dispatch", "chained"),  # its old name
    ],
)
def test_override_values_parse_to_the_field_type(override, section, key, expected):
    value = getattr(getattr(load_config(None, [override]), section), key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    "override, section, key, expected",
    [
        ("tracking.run_name=2024", "tracking", "run_name", "2024"),
        ("tracking.experiment=yes", "tracking", "experiment", "yes"),
        ("train.save_final=1", "train", "save_final", "1"),
    ],
)
def test_string_fields_keep_override_text_that_looks_like_another_type(override, section, key, expected):
    """A run named 2024 or an experiment named 'yes' is a string field given a string on the command line."""
    assert getattr(getattr(load_config(None, [override]), section), key) == expected


def test_model_preset_fills_dimensions_and_explicit_dims_override_it():
    cfg = load_config(None, ["model.preset=small"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (6, 6, 384)
    cfg = load_config(None, ["model.preset=small", "model.n_layer=3"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (3, 6, 384)
    # order of the overrides does not matter
    cfg = load_config(None, ["model.n_layer=3", "model.preset=small"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (3, 6, 384)


def test_model_preset_from_file_with_dims_from_overrides(tmp_path):
    path = write(tmp_path, "model:\n  preset: medium\n  n_head: 6\n")
    cfg = load_config(path, ["model.n_embd=384"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (12, 6, 384)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_loads(name):
    cfg = load_config(None, [f"model.preset={name}"])
    assert {k: getattr(cfg.model, k) for k in PRESETS[name]} == PRESETS[name]


@pytest.mark.parametrize(
    "global_bs, micro, workers, accum",
    [(16, 4, 2, 2), (32, 2, 4, 4), (8, 8, 1, 1), (24, 2, 3, 4), (7, 7, 1, 1)],
)
def test_grad_accum_is_global_over_micro_times_workers(global_bs, micro, workers, accum):
    cfg = load_config(
        None,
        [
            f"train.global_batch_size={global_bs}",
            f"train.micro_batch_size={micro}",
            f"cluster.num_workers={workers}",
        ],
    )
    assert cfg.mesh().size("batch") == workers
    assert cfg.grad_accum == accum
    assert cfg.grad_accum * micro * workers == global_bs


def test_block_size_defaults_to_seq_len_and_may_be_larger():
    assert load_config(None, ["train.seq_len=64"]).block_size == 64
    cfg = load_config(None, ["train.seq_len=64", "model.block_size=256"])
    assert cfg.block_size == 256 and cfg.model.block_size == 256


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(pydantic.ValidationError):
        cfg.train.steps = 5  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.train = RunConfig()  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.model.n_layer = 9  # type: ignore[misc]
    assert cfg.train.steps == RunConfig().steps


def test_flat_gives_a_dotted_key_for_every_leaf():
    cfg = load_config(None, ["train.steps=42", "model.preset=small"])
    flat = cfg.flat()
    expected_keys = {
        f"{section}.{f.alias or field}"  # the key a user writes (checkpoint.async, not async_)
        for section, info in RootConfig.model_fields.items()
        for field, f in info.annotation.model_fields.items()
    }
    assert set(flat) == expected_keys
    assert flat["train.steps"] == 42
    assert flat["model.n_layer"] == 6
    assert flat["model.preset"] == "small"
    assert flat["optim.lr"] == cfg.optim.lr
    assert flat["cluster.num_workers"] == cfg.cluster.num_workers
    assert not any(isinstance(v, dict) for v in flat.values())


# --------------------------------------------------------------------------- user mistakes


def test_unknown_key_names_it_and_suggests_the_close_one():
    msg = error_of(overrides=["train.stepz=5"])
    assert "train.stepz" in msg
    assert "did you mean 'steps'" in msg


def test_unknown_key_in_model_suggests_the_field():
    msg = error_of(overrides=["model.n_layers=3"])
    assert "model.n_layers" in msg and "'n_layer'" in msg


def test_unknown_key_without_a_close_match_lists_what_is_accepted():
    msg = error_of(overrides=["train.qqqqqqq=1"])
    assert "train.qqqqqqq" in msg and "unknown key" in msg
    assert "did you mean" not in msg
    assert "steps" in msg and "global_batch_size" in msg


def test_unknown_key_in_yaml_file_is_reported_like_an_override(tmp_path):
    msg = error_of(write(tmp_path, "optim:\n  learning_rate: 0.1\n"))
    assert "optim.learning_rate" in msg and "unknown key" in msg


def test_unknown_section_names_it_and_suggests_the_close_one():
    msg = error_of(overrides=["trian.steps=5"])
    assert "trian" in msg and "did you mean 'train'" in msg


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=abc", "train.steps"),
        ("train.steps=2.5", "train.steps"),
        ("optim.lr=fast", "optim.lr"),
        ("cluster.use_gpu=maybe", "cluster.use_gpu"),
        ("cluster.num_workers=[1, 2]", "cluster.num_workers"),
    ],
)
def test_wrong_type_names_the_key_and_the_value(override, key):
    msg = error_of(overrides=[override])
    assert key in msg
    assert "(got " in msg  # the offending value is shown


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=0", "train.steps"),
        ("train.micro_batch_size=0", "train.micro_batch_size"),
        ("optim.lr=-1", "optim.lr"),
        ("optim.lr=0", "optim.lr"),
        ("optim.beta2=1.0", "optim.beta2"),
        ("cluster.num_workers=0", "cluster.num_workers"),
        ("sharding.bucket_numel=0", "sharding.bucket_numel"),
        ("train.seed=-3", "train.seed"),
    ],
)
def test_out_of_range_value_names_the_key(override, key):
    msg = error_of(overrides=[override])
    assert key in msg
    assert override.partition("=")[2] in msg  # the offending value is shown


def test_bad_literal_lists_the_allowed_values():
    msg = error_of(overrides=["sharding.strategy=zero9"])
    assert "sharding.strategy" in msg and "zero9" in msg
    assert "'no_shard'" in msg and "'optim'" in msg


def test_bad_preset_lists_the_presets():
    msg = error_of(overrides=["model.preset=huge"])
    assert "model.preset" in msg
    for name in PRESETS:
        assert repr(name) in msg


def test_global_batch_not_divisible_names_the_key_and_the_numbers():
    msg = error_of(
        overrides=["train.global_batch_size=10", "train.micro_batch_size=4", "cluster.num_workers=2"]
    )
    assert "train.global_batch_size" in msg
    assert "10" in msg and "8" in msg  # 10 is not divisible by 4 x 2 = 8
    assert "train.micro_batch_size" in msg


def test_n_embd_not_divisible_by_n_head():
    msg = error_of(overrides=["model.n_embd=130"])  # tiny preset: 4 heads
    assert "model" in msg and "n_embd" in msg and "n_head" in msg
    assert "130" in msg


def test_non_positive_model_dimension_is_rejected():
    msg = error_of(overrides=["model.n_layer=0"])
    assert "model" in msg and "n_layer" in msg


def test_block_size_shorter_than_seq_len():
    msg = error_of(overrides=["train.seq_len=128", "model.block_size=64"])
    assert "model.block_size" in msg and "64" in msg and "128" in msg


def test_min_lr_above_lr():
    msg = error_of(overrides=["optim.lr=0.001", "optim.min_lr=0.01"])
    assert "optim.min_lr" in msg


def test_min_lr_equal_to_lr_is_allowed():
    cfg = load_config(None, ["optim.lr=0.001", "optim.min_lr=0.001"])
    assert cfg.optim.min_lr == cfg.optim.lr


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    msg = error_of(missing)
    assert str(missing) in msg and "does not exist" in msg


def test_directory_instead_of_a_config_file(tmp_path):
    msg = error_of(tmp_path)
    assert str(tmp_path) in msg


def test_invalid_yaml(tmp_path):
    path = write(tmp_path, "train: [steps: 1\n")
    msg = error_of(path)
    assert str(path) in msg and "YAML" in msg


@pytest.mark.parametrize("text, kind", [("- train\n- optim\n", "list"), ("just words\n", "str"), ("3\n", "int")])
def test_yaml_that_is_not_a_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    msg = error_of(path)
    assert str(path) in msg and "mapping" in msg and kind in msg


def test_section_that_is_not_a_mapping(tmp_path):
    assert "train" in error_of(write(tmp_path, "train: 5\n"))
    assert "train" in error_of(overrides=["train=5"])


@pytest.mark.parametrize("item", ["train.steps", "", "=5", "   =5"])
def test_override_without_key_value_form(item):
    msg = error_of(overrides=[item])
    assert repr(item) in msg and "key=value" in msg


def test_overriding_a_value_as_if_it_were_a_section():
    msg = error_of(overrides=["train.steps.x=1"])
    assert "train.steps" in msg
    msg = error_of(overrides=["train.steps=5", "train.steps.x=1"])
    assert "train.steps" in msg and "not a section" in msg


def test_overriding_a_file_value_as_if_it_were_a_section(tmp_path):
    msg = error_of(write(tmp_path, "train:\n  steps: 5\n"), ["train.steps.x=1"])
    assert "train.steps" in msg and "not a section" in msg


def test_several_mistakes_are_reported_together():
    msg = error_of(overrides=["train.steps=0", "optim.lr=-1", "train.stepz=1"])
    assert "train.steps" in msg and "optim.lr" in msg and "train.stepz" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_model_config_alone_fills_from_preset():
    m = ModelConfig(preset="large", n_head=8)
    assert (m.n_layer, m.n_head, m.n_embd) == (24, 8, 1024)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "examples" / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_config(path)
    assert cfg.train.steps >= 1 and cfg.grad_accum >= 1


def test_compiled_blocks_refuse_selective_recomputation():
    """`selective` picks the ops it keeps inside a block; a compiled block runs as one op to it."""
    assert "train.compile: model.activation_checkpointing=selective" in error_of(
        overrides=["train.compile=true", "model.activation_checkpointing=selective"])
    for mode in ("full", "every:2", "none"):
        assert load_config(None, ["train.compile=true", f"model.activation_checkpointing={mode}"]).train.compile
    assert "train.compile_backend" in error_of(overrides=["train.compile_backend=cudagraphs"])
