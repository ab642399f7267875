"""Every URI a run and the tools take, in S3 (the session's SeaweedFS), reached with the
`checkpoint.s3_*` settings alone: no `AWS_*` variable is set. `rayzero train`, `ckpt` and
`generate` run by the CLI's `main` in this process, the runs on the session's Ray cluster;
`rayzero data prepare`'s source and output: tests/unit/test_storage.py."""

import pyarrow.fs as pafs
import pytest
import torch
from safetensors.torch import load, save

from rayzero.checkpoint.manifest import open_checkpoint
from rayzero.config import load_config
from rayzero.models.gpt import build_model
from tests.conftest import cli_in_process
from tests.e2e.test_checkpoints import FAST
from tests.s3server import without_aws_variables

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_every_uri_in_s3_with_only_the_checkpoint_settings(tmp_path, s3_server, small_dataset, train_here, capsys,
                                                           monkeypatch):
    without_aws_variables(monkeypatch)
    s3, fs = s3_server.overrides(), s3_server.fs()
    fs.create_dir("uris")
    pafs.copy_files(small_dataset, "uris/data", destination_filesystem=fs)
    cfg = load_config(None, FAST)
    start = build_model(cfg.model, cfg.block_size, seed=7).state_dict()
    with fs.open_output_stream("uris/model/model.safetensors") as f:
        f.write(save({k: v.clone() for k, v in start.items()}))  # tied weights saved apart

    # data.path and model.path read, checkpoint.dir and train.save_final written, all in S3
    run = ["data.path=s3://uris/data", "model.path=s3://uris/model", *FAST, *s3, "train.steps=4",
           "checkpoint.every_steps=2"]
    code, out, err, s = train_here(*run, "checkpoint.dir=s3://uris/ckpt",
                                   "train.save_final=s3://uris/final.safetensors")
    assert code == 0, err[-3000:]
    assert s["checkpoint"] == "s3://uris/ckpt/step-000004" and s["final_weights"] == "s3://uris/final.safetensors"
    settings = load_config(None, s3).checkpoint.storage
    source = open_checkpoint("s3://uris/ckpt", settings).manifest["model_source"]
    assert (source["source"], source["init"]) == ("s3://uris/model", "pretrained")
    assert s3_server.SECRET not in out + err

    # checkpoint.resume: a commit by its URI
    code, _, err, s = train_here(*run, "checkpoint.dir=s3://uris/ckpt-b",
                                 "checkpoint.resume=s3://uris/ckpt/step-000002", summary="b.json")
    assert code == 0, err[-3000:]
    assert s["resumed_from"] == "s3://uris/ckpt/step-000002" and (s["start_step"], s["steps"]) == (2, 2)

    # `rayzero ckpt export` to S3: the final weights, as the run saved them
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "ckpt", "export", "s3://uris/ckpt",
                                  "s3://uris/export/w.safetensors", *s3)
    assert code == 0, err

    def tensors(path: str) -> dict[str, torch.Tensor]:
        with fs.open_input_stream(path) as f:
            return load(f.read())

    exported, final = tensors("uris/export/w.safetensors"), tensors("uris/final.safetensors")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)

    # `rayzero generate` from the checkpoint and from the final weights: the same model, the same text
    said = []
    for source in (["s3://uris/ckpt"], ["s3://uris/final.safetensors", *FAST, "data.path=s3://uris/data"]):
        code, text, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", *source, "--prompt", "def f(",
                                         "--max-new-tokens", "8", *s3)
        assert code == 0, err
        said.append(text)
    assert said[0] == said[1] and said[0].startswith("def f(")


def test_credentials_only_in_the_environment_reach_every_rank(tmp_path, s3_server, small_dataset, train_here,
                                                              monkeypatch):
    """The S3 keys and endpoint only as the AWS_* variables of the command that joins the
    cluster (the ranks are processes its head started, without them): data read and checkpoints
    written by the ranks, the run directory's config.json without the keys; a bucket that does
    not exist is refused before Ray is touched, naming it."""
    without_aws_variables(monkeypatch)
    for name, value in {"AWS_ACCESS_KEY_ID": s3_server.KEY, "AWS_SECRET_ACCESS_KEY": s3_server.SECRET,
                        "AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_DEFAULT_REGION": s3_server.REGION}.items():
        monkeypatch.setenv(name, value)
    fs = s3_server.fs()
    pafs.copy_files(small_dataset, "uris/env-data", destination_filesystem=fs)
    run = ["data.path=s3://uris/env-data", *FAST, "train.steps=2", "checkpoint.every_steps=2",
           f"train.output_dir={tmp_path / 'runs'}"]
    code, out, err, s = train_here(*run, "checkpoint.dir=s3://uris/env-ckpt")
    assert code == 0, err[-3000:]
    assert s["checkpoint"] == "s3://uris/env-ckpt/step-000002" and s["checkpoints_committed"] == 1
    shown = (tmp_path / "runs").rglob("config.json")
    assert all(s3_server.KEY not in p.read_text() and s3_server.SECRET not in p.read_text() for p in shown)
    assert s3_server.SECRET not in out + err

    code, _, err, _ = train_here(*run, "checkpoint.dir=s3://no-such-bucket/run", summary="missing.json")
    assert code == 2 and "s3://no-such-bucket/run: the bucket 'no-such-bucket' does not exist; create it, or set " \
                         "checkpoint.s3_create_bucket=true" in err, err[-2000:]
    assert fs.get_file_info("no-such-bucket").type == pafs.FileType.NotFound, "nothing made"
