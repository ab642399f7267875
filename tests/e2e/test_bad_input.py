"""A user's mistake ends before training with one clear message and no traceback."""

import pytest

from rayzero.data.tokens import prepare
from tests.e2e.conftest import run_cli


@pytest.mark.parametrize("args, expected", [
    (["train.stepz=3"], "train.stepz: unknown key; did you mean 'steps'?"),
    (["train.steps=many"], "train.steps: Input should be a valid integer"),
    (["sharding.strategy=zero9"], "sharding.strategy: Input should be 'no_shard', 'optim', 'optim_grads' or 'optim_grads_params'"),
    (["train.global_batch_size=10"], "train.global_batch_size: 10 is not divisible"),
    (["data.path=DATA", "sharding.strategy=optim_grads_params", "sharding.fsdp_units=Blok"],
     "sharding.fsdp_units: no module of GPT has class Blok; its module classes are"),
    (["cluster.num_workers=4", "sharding.dp_outer=3"], "sharding.dp_outer: 3 does not divide cluster.num_workers (4)"),
    (["sharding.param_dtype=fp16", "sharding.loss_scale=none"], "fp16 parameters need loss scaling"),
    (["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
    (["data.path=/nonexistent/data"], "no dataset at /nonexistent/data"),
    (["cluster.address=127.0.0.1:1", "data.path=DATA"], "cluster.address: cannot connect"),
    (["data.path=DATA", "train.save_final=nosuch://bucket/w.safetensors"], "train.save_final: 'nosuch://bucket/w.safetensors' cannot be written"),
    (["data.path=DATA", "train.save_final=/proc/version/w.safetensors"], "train.save_final: '/proc/version/w.safetensors' cannot be written"),
])
def test_bad_input_is_one_clear_message(tmp_path, small_dataset, args, expected):
    args = [a.replace("DATA", small_dataset) for a in args]
    r = run_cli("train", *args, cwd=tmp_path, timeout=180)
    assert r.returncode == 2, r.stderr
    assert expected in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists() or "cluster.address" in expected


def test_corpus_too_small_for_one_global_batch(tmp_path):
    (tmp_path / "a.txt").write_text("tiny corpus " * 20)
    prepare(tmp_path / "a.txt", str(tmp_path / "d"))
    r = run_cli("train", f"data.path={tmp_path / 'd'}", cwd=tmp_path)
    assert r.returncode == 2
    assert "data.path" in r.stderr and "fewer than one global batch" in r.stderr
    assert "Traceback" not in r.stderr
