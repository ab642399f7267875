"""The one storage rule (rayzero/storage.py): a URI names its filesystem and path, s3:// with
the `checkpoint.s3_*` settings; against the suite's SeaweedFS with those settings alone (no
`AWS_*` variable), what needs no Ray: `rayzero data prepare`'s source and output, and the final
weights' checks and writes. tests/e2e/test_storage.py trains with every other URI in S3."""

import dataclasses
import json

import pyarrow.fs as pafs
import pytest
import torch

from rayzero.checkpoint.export import (
    MODEL_KEY, Tensor, check_destination, check_final, read_export_identity, save_safetensors, write_hf_dir,
)
from rayzero.config import load_config
from rayzero.data.tokens import TokenDataset, read_meta
from rayzero.storage import Storage, StorageError, StorageSettings, filesystem
from tests.conftest import cli_in_process
from tests.s3server import without_aws_variables


def test_a_uri_names_its_filesystem_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = tmp_path.resolve()
    fs, path = filesystem("out/w.safetensors")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(here / "out" / "w.safetensors")
    assert filesystem(f"file://{here}/x/") == (fs, str(here / "x"))
    fs, path = filesystem("s3://bucket/a/b/", StorageSettings(endpoint="http://127.0.0.1:9", region="eu-west-1"))
    assert isinstance(fs, pafs.S3FileSystem) and path == "bucket/a/b" and fs.region == "eu-west-1"
    with pytest.raises(StorageError, match="nosuch://bucket/x"):
        filesystem("nosuch://bucket/x")
    with pytest.raises(StorageError, match="unsupported scheme"):  # a Storage root: local or s3:// only
        Storage("nosuch://bucket/x")


def test_the_settings_are_the_checkpoint_configs_and_never_show_the_secret():
    cfg = load_config(None, ["checkpoint.s3_endpoint=http://host:8333", "checkpoint.s3_region=r",
                             "checkpoint.s3_access_key_id=key", "checkpoint.s3_secret_access_key=s3cret",
                             "checkpoint.retries=1"]).checkpoint
    assert cfg.storage == StorageSettings(endpoint="http://host:8333", region="r", access_key_id="key",
                                          secret_access_key="s3cret", retries=1)
    assert "s3cret" not in repr(cfg.storage)


def test_data_prepare_reads_and_writes_s3_with_the_checkpoint_settings(tmp_path, s3_server, capsys, monkeypatch):
    without_aws_variables(monkeypatch)
    fs = s3_server.fs()
    fs.create_dir("prepare-src")
    docs = ["the first document", "a second one", "and a third, ünïcode"]
    for i, text in enumerate(docs):
        with fs.open_output_stream(f"prepare-src/docs/{i}.txt") as f:
            f.write(text.encode())
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "s3://prepare-src/docs/*.txt",
                                    "s3://prepare-out/tokens", "--no-progress", *s3_server.overrides())
    assert code == 0, err
    assert "from 3 documents" in out and "s3://prepare-out/tokens" in out
    settings = load_config(None, s3_server.overrides()).checkpoint.storage
    ds = TokenDataset("s3://prepare-out/tokens", storage_cfg=settings)
    assert ds.window(0, ds.num_tokens).tolist() == [b for d in docs for b in [*d.encode(), 256]]
    assert read_meta("s3://prepare-out/tokens", settings)["num_documents"] == 3


def test_the_final_weights_check_and_write_s3_with_the_checkpoint_settings(s3_server, monkeypatch):
    """What `train.save_final=s3://…` does before and after training (the run itself:
    tests/e2e/test_storage.py)."""
    without_aws_variables(monkeypatch)
    settings = load_config(None, s3_server.overrides()).checkpoint.storage
    mine = {"kind": "gpt", "source": None, "config_sha256": "a"}
    other = {**mine, "config_sha256": "b"}
    for fmt, uri in (("safetensors", "s3://final-unit/w.safetensors"), ("hf", "s3://final-unit/hf")):
        check_destination(uri, settings)
        check_final(uri, fmt, mine, False, settings)  # nothing there yet
        if fmt == "hf":
            write_hf_dir(uri, [Tensor("w", (2,), torch.float32, lambda: torch.ones(2))], {"config.json": b"{}"},
                         10**9, {MODEL_KEY: json.dumps(mine)}, storage_cfg=settings)
        else:
            save_safetensors({"w": torch.ones(2)}, uri, {MODEL_KEY: json.dumps(mine)}, settings)
        assert read_export_identity(uri, fmt, settings) == mine
        with pytest.raises(ValueError, match="already holds an export of gpt model"):
            check_final(uri, fmt, other, False, settings)
    wrong = dataclasses.replace(settings, secret_access_key="wrong")
    with pytest.raises(ValueError, match="SIGNATURE_DOES_NOT_MATCH"):  # found before training, in one line
        check_destination("s3://final-unit/again.safetensors", wrong)
