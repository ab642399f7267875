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
    with pytest.raises(ValueError, match="ACCESS_DENIED .*the S3 credentials"):  # found before training, in one line
        check_destination("s3://final-unit/again.safetensors", wrong)


def test_the_aws_variables_fill_what_the_settings_leave_empty_for_the_ranks():
    from rayzero.checkpoint.config import CheckpointConfig

    env = {"AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "s3cret", "AWS_SESSION_TOKEN": "tok",
           "AWS_ENDPOINT_URL": "http://e:1", "AWS_DEFAULT_REGION": "r"}
    got = CheckpointConfig().with_environment(env).storage
    assert got == StorageSettings(endpoint="http://e:1", region="r", access_key_id="key", secret_access_key="s3cret",
                                  session_token="tok")
    assert "s3cret" not in repr(got) and "tok" not in repr(got)
    given = load_config(None, ["checkpoint.s3_endpoint=http://mine:2", "checkpoint.s3_access_key_id=mine",
                               "checkpoint.s3_secret_access_key=other"]).checkpoint
    got = given.with_environment({**env, "AWS_ENDPOINT_URL_S3": "http://s3only:3"}).storage
    assert (got.endpoint, got.access_key_id, got.secret_access_key, got.region) == ("http://mine:2", "mine", "other", "r")
    alone = CheckpointConfig().with_environment({"AWS_ACCESS_KEY_ID": "key"}).storage  # a key without its secret
    assert alone.access_key_id == "" and CheckpointConfig().with_environment({}) == CheckpointConfig()


def test_a_bucket_that_does_not_exist_is_refused_by_name_or_made_when_asked(tmp_path, s3_server, capsys,
                                                                           monkeypatch):
    without_aws_variables(monkeypatch)
    s3 = s3_server.overrides()
    settings = load_config(None, s3).checkpoint.storage
    with pytest.raises(StorageError, match="s3://missing-a/run: the bucket 'missing-a' does not exist; create it, "
                                           "or set checkpoint.s3_create_bucket=true"):
        Storage("s3://missing-a/run", settings).probe()
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "ckpt", "ls", "s3://missing-a/run", *s3)
    assert code == 2 and "the bucket 'missing-a' does not exist" in err and not out, (out, err)
    (tmp_path / "d.txt").write_text("a document")
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "d.txt", "s3://missing-a/tokens",
                                  "--no-progress", *s3)
    assert code == 2 and err.count("\n") == 1 and "the bucket 'missing-a' does not exist" in err, err
    with pytest.raises(ValueError, match="the bucket 'missing-a' does not exist"):
        check_destination("s3://missing-a/w.safetensors", settings)
    assert s3_server.fs().get_file_info("missing-a").type == pafs.FileType.NotFound
    Storage("s3://missing-a/run", dataclasses.replace(settings, create_bucket=True)).probe()  # asked: made
    assert s3_server.fs().get_file_info("missing-a").type == pafs.FileType.Directory


def test_refused_credentials_are_one_line_naming_what_to_fix(tmp_path, s3_server, capsys, monkeypatch):
    without_aws_variables(monkeypatch)
    wrong = [o if not o.startswith("checkpoint.s3_secret_access_key=") else "checkpoint.s3_secret_access_key=wrong"
             for o in s3_server.overrides()]
    (tmp_path / "d.txt").write_text("a document")
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", "d.txt", "s3://prepare-out/bad",
                                  "--no-progress", *wrong)
    assert code == 2 and err.startswith("rayzero: error: ") and err.count("\n") == 1, err
    assert "the S3 credentials: checkpoint.s3_access_key_id" in err and "=wrong" not in err
    with pytest.raises(Exception) as e:
        read_meta("s3://prepare-out/tokens", load_config(None, wrong).checkpoint)
    assert type(e.value).__name__ == "DataError" and "cannot read the dataset at s3://prepare-out/tokens" in str(e.value)


def test_generate_reads_hf_and_peft_directories_in_s3_as_local_ones(tmp_path, s3_server, capsys, monkeypatch):
    """The directories `ckpt export --format hf|peft` write to S3 are models `rayzero generate`
    takes: an HF model, and a PEFT adapter whose base is in S3 too."""
    import peft
    import transformers as tf

    from tests.models import save_hf_model, save_tokenizer

    without_aws_variables(monkeypatch)
    fs = s3_server.fs()
    model = save_hf_model("llama", tmp_path / "llama")
    save_tokenizer(model, ["def f(x):\n    return x\n" * 20], vocab=300)
    pafs.copy_files(str(model), "models/hf-llama", destination_filesystem=fs)
    lora = peft.get_peft_model(tf.AutoModelForCausalLM.from_pretrained(str(model)),
                               peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "s3://models/hf-llama"}))
    pafs.copy_files(str(tmp_path / "adapter"), "models/adapter", destination_filesystem=fs)
    said = []
    for where in ([str(model)], ["s3://models/hf-llama"], [str(tmp_path / "adapter"), f"model.path={model}"],
                  ["s3://models/adapter"]):
        code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", *where, "--prompt", "def f(",
                                        "--max-new-tokens", "4", "--raw", *s3_server.overrides())
        assert code == 0, (where, err)
        said.append(out)
    assert said[0] == said[1] and said[0].startswith("def f(")
    assert said[2] == said[3], "the adapter from S3 onto its base from S3: what it gives locally"
