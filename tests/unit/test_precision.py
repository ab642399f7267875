"""The precision policy's config checks, the loss scaler, and the device check."""

import pytest
import torch

from rayzero.config import ConfigError, load_config
from rayzero.sharding.memory import formula_bytes_per_param
from rayzero.sharding.precision import LossScaler, Precision, build_loss_scaler
from rayzero.workers.assembly import check_buildable


@pytest.mark.parametrize("overrides, message", [
    (["sharding.param_dtype=fp16", "sharding.loss_scale=none"], "fp16 parameters need loss scaling"),
    (["cluster.num_workers=4", "sharding.dp_outer=3"], "dp_outer: 3 does not divide cluster.num_workers"),
    (["sharding.strategy=no_shard", "sharding.dp_outer=2"], "needs a sharded strategy"),
    (["sharding.param_dtype=fp8"], "param_dtype"),
    (["sharding.outer_strategy=optim_grads"], "outer_strategy"),
])
def test_bad_precision_and_hybrid_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_fsdp_units_from_the_command_line_and_comm_dtype_default():
    cfg = load_config(None, ["sharding.fsdp_units=Block, Embedding", "sharding.grad_dtype=bf16"])
    assert cfg.sharding.fsdp_units == ("Block", "Embedding")
    p = Precision.from_config(cfg.sharding)
    assert p.comm == torch.bfloat16 and p.main == torch.float32 and p.main_is_param


def test_loss_scaling_defaults_to_dynamic_for_fp16_only():
    assert build_loss_scaler(load_config(None, []).sharding) is None
    fp16 = build_loss_scaler(load_config(None, ["sharding.param_dtype=fp16"]).sharding)
    assert fp16.dynamic and fp16.scale == 2.0**16
    fixed = build_loss_scaler(load_config(None, ["sharding.loss_scale=128"]).sharding)
    assert not fixed.dynamic and fixed.scale == 128


def test_dynamic_scale_halves_on_overflow_and_doubles_after_a_window():
    s = LossScaler(1024, window=3)
    s.update(finite=False)
    assert s.scale == 512
    for _ in range(3):
        s.update(finite=True)
    assert s.scale == 1024
    s.update(True), s.update(False), s.update(True), s.update(True)
    assert s.scale == 512, "an overflow restarts the window"


def test_a_dtype_the_device_cannot_do_is_refused_before_training():
    if torch.cuda.is_available():
        pytest.skip("this machine's CUDA can do bf16")
    cfg = load_config(None, ["sharding.param_dtype=bf16"])
    with pytest.raises(ValueError, match="sharding.param_dtype=bf16: cuda cannot compute in torch.bfloat16"):
        check_buildable(cfg, torch.device("cuda"))
    check_buildable(cfg, torch.device("cpu"))  # the CPU can


def test_unit_classes_are_checked_before_training():
    cfg = load_config(None, ["sharding.strategy=optim_grads_params", "sharding.fsdp_units=Transformer"])
    with pytest.raises(ValueError, match="no module of GPT has class Transformer"):
        check_buildable(cfg, None)


@pytest.mark.parametrize("strategy, d, fp32, bf16", [
    ("no_shard", 4, 16, 18), ("optim", 4, 8 + 8 / 4, 6 + 12 / 4),
    ("optim_grads", 4, 4 + 12 / 4, 2 + 16 / 4), ("optim_grads_params", 4, 16 / 4, 18 / 4),
])
def test_formula_is_megatrons_table(strategy, d, fp32, bf16):
    assert formula_bytes_per_param(strategy, d) == fp32
    assert formula_bytes_per_param(strategy, d, param_bytes=2) == bf16
