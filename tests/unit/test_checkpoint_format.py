"""The shard file format, its checksums, the reshard arithmetic, pruning, and model checks."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rayzero.checkpoint.manifest import (
    CheckpointError, check_model, committed, prune, read_manifest, step_dir, write_manifest,
)
from rayzero.checkpoint.shard_file import BLOCK, ChecksumError, ShardReader, verify, write_shard
from rayzero.checkpoint.shards import _coalesce, locate_saved
from rayzero.storage import Storage, StorageError


def tensors(n=3 * BLOCK // 4 + 5):  # spans several 4 MiB blocks
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=g) for name in ("main", "exp_avg", "exp_avg_sq")}


def test_a_shard_is_plain_safetensors_and_ranged_reads_are_exact(tmp_path):
    st, t = Storage(str(tmp_path)), tensors()
    entry = write_shard(st, "s.safetensors", t, {"step": "7"})
    assert entry["size"] == (tmp_path / "s.safetensors").stat().st_size
    assert len(entry["sha256"]) == -(-entry["size"] // BLOCK) > 2
    loaded = load_file(tmp_path / "s.safetensors")  # the library reads it as it is
    assert all(torch.equal(loaded[k], v) for k, v in t.items())
    r = ShardReader(st, "s.safetensors", entry)
    assert r.metadata == {"step": "7"}
    for name, lo, hi in [("main", 0, 10), ("exp_avg", BLOCK // 4 - 3, BLOCK // 4 + 3), ("exp_avg_sq", 17, len(t["main"]))]:
        assert torch.equal(torch.from_numpy(r.read(name, lo, hi).copy()), t[name][lo:hi])
    verify(st, "s.safetensors", entry)


def test_a_flipped_byte_fails_the_block_that_holds_it_naming_the_file(tmp_path):
    st, t = Storage(str(tmp_path)), tensors()
    entry = write_shard(st, "s.safetensors", t, {})
    raw = bytearray((tmp_path / "s.safetensors").read_bytes())
    raw[BLOCK + 100] ^= 1
    (tmp_path / "s.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match=r"s.safetensors: block 1 fails its checksum"):
        verify(st, "s.safetensors", entry)
    r = ShardReader(st, "s.safetensors", entry)
    r.read("main", 0, 100)  # block 0 is fine: a ranged read there still works
    with pytest.raises(ChecksumError, match="block 1"):
        r.read("main", 0, len(t["main"]))


def test_locate_walks_saved_pieces_and_coalesce_joins_adjacent_reads():
    # Saved: rank 0 holds world [0, 10) and [20, 30); rank 1 holds [10, 20) and [30, 40).
    pieces = sorted([(0, 10, 0, 0), (20, 30, 0, 10), (10, 20, 1, 0), (30, 40, 1, 10)])
    starts = [p[0] for p in pieces]
    assert locate_saved(5, 25, 100, pieces, starts) == [(0, 5, 5, 100), (1, 0, 10, 105), (0, 10, 5, 115)]
    with pytest.raises(ValueError, match="in no shard"):
        locate_saved(40, 41, 0, pieces, starts)
    runs = _coalesce([(0, 0, 4, 50), (0, 4, 6, 10), (1, 0, 2, 0), (0, 20, 1, 5)])
    assert runs == [[0, 0, 10, [(0, 50, 4), (4, 10, 6)]], [0, 20, 1, [(0, 5, 1)]], [1, 0, 2, [(0, 0, 2)]]]


def manifest(step):
    return {"format": "rayzero-checkpoint", "version": 1, "step": step, "shards": [],
            "params": [{"name": "w", "shape": [2, 3]}, {"name": "b", "shape": [3]}]}


def test_only_prefixes_with_a_manifest_count_and_pruning_keeps_the_newest(tmp_path):
    root = Storage(str(tmp_path))
    for step in (2, 4, 6, 8):
        write_manifest(root.child(step_dir(step)), manifest(step))
    (tmp_path / step_dir(7)).mkdir()  # a crash mid-upload: shards, no manifest
    (tmp_path / step_dir(9)).mkdir()  # an upload still going on, newer than every commit
    (tmp_path / "notes").mkdir()
    assert [c.step for c in committed(root)] == [2, 4, 6, 8]
    assert sorted(prune(root, keep_last=2)) == [step_dir(2), step_dir(4), step_dir(7)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", step_dir(6), step_dir(8), step_dir(9)]
    with pytest.raises(CheckpointError, match="no manifest.json: never committed"):
        read_manifest(root.child(step_dir(9)))
    (tmp_path / step_dir(6) / "manifest.json").write_text(json.dumps({**manifest(6), "version": 99}))
    with pytest.raises(CheckpointError, match="v99"):
        read_manifest(root.child(step_dir(6)))


def test_another_model_lists_every_mismatch():
    with pytest.raises(CheckpointError) as e:
        check_model(manifest(1), {"w": [2, 4], "c": [1]}, "s3://b/x")
    text = str(e.value)
    assert "s3://b/x holds a different model" in text
    assert "c: missing from the checkpoint" in text and "b: not in the model" in text
    assert "w: shape [2, 3] in the checkpoint, [2, 4] in the model" in text


def test_a_manifest_that_does_not_parse_is_passed_over_with_a_warning(tmp_path, caplog):
    root = Storage(str(tmp_path))
    for step in (2, 4):
        write_manifest(root.child(step_dir(step)), manifest(step))
    (tmp_path / step_dir(4) / "manifest.json").write_text('{"format": "rayzero-checkpoint", "ver')
    (tmp_path / step_dir(6)).mkdir()  # never committed: passed over without a word
    assert [c.step for c in committed(root)] == [2]
    assert f"checkpoint {tmp_path / step_dir(4)} is damaged" in caplog.text and "is not valid JSON" in caplog.text
    assert step_dir(6) not in caplog.text


def test_another_kind_of_model_or_other_frozen_parameters_are_refused(caplog):
    m = {**manifest(1), "model_source": {"kind": "gpt", "config_sha256": "aaa"}, "frozen": ["b"]}
    params = {p["name"]: p["shape"] for p in m["params"]}
    with pytest.raises(CheckpointError, match="model.kind: gpt in the checkpoint, hf here"):
        check_model(m, params, "x", frozen=["b"], model={"kind": "hf"})
    with pytest.raises(CheckpointError) as e:
        check_model(m, params, "x", frozen=["w"], model={"kind": "gpt", "config_sha256": "aaa"})
    assert "w: frozen here, trained in the checkpoint" in str(e.value)
    assert "b: trained here, frozen in the checkpoint" in str(e.value)
    check_model(m, params, "x", frozen=["b"], model={"kind": "gpt", "config_sha256": "bbb"})
    assert "saved from a model of another config" in caplog.text


def test_storage_names_the_uri_and_refuses_unknown_schemes(tmp_path):
    with pytest.raises(StorageError, match="unsupported scheme"):
        Storage("gs://bucket/x")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match=str(blocker / "ck")):
        Storage(str(blocker / "ck"), None).probe()


# --------------------------------------------------------------------------- the final export

def test_save_final_refuses_another_models_export_and_rewrites_its_own(tmp_path):
    import torch

    from rayzero.checkpoint.export import MODEL_KEY, check_final, export_identity, save_safetensors

    mine = export_identity({"kind": "hf", "source": "/m/a", "config_sha256": "111", "seed": 0})
    theirs = export_identity({"kind": "hf", "source": "/m/b", "config_sha256": "222"})
    out = str(tmp_path / "final.safetensors")
    check_final(out, "safetensors", mine, overwrite=False)  # nothing there yet
    save_safetensors({"w": torch.ones(2)}, out, {MODEL_KEY: json.dumps(theirs)})
    with pytest.raises(ValueError, match=r"already holds an export of hf model /m/b \(config 222\), and this run "
                                         r"trains hf model /m/a \(config 111\); .*train.overwrite_final=true"):
        check_final(out, "safetensors", mine, overwrite=False)
    check_final(out, "safetensors", mine, overwrite=True)
    check_final(out, "safetensors", theirs, overwrite=False)  # the same model again: rewritten
    (tmp_path / "notes.safetensors").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="files rayzero did not write"):
        check_final(str(tmp_path / "notes.safetensors"), "safetensors", mine, overwrite=False)


def test_an_hf_directory_appears_whole_or_not_at_all(tmp_path):
    import torch

    from rayzero.checkpoint.export import MODEL_KEY, Tensor, read_export_identity, write_hf_dir

    out = tmp_path / "hf"
    ident = {"kind": "hf", "source": "x", "config_sha256": "1"}
    good = [Tensor("a", (2,), torch.float32, lambda: torch.ones(2))]
    write_hf_dir(str(out), good, {"config.json": b"{}"}, 10**9, {MODEL_KEY: json.dumps(ident)})
    assert read_export_identity(str(out), "hf") == ident

    def fails():
        raise RuntimeError("the machine went away mid-export")

    with pytest.raises(RuntimeError):
        write_hf_dir(str(out), [Tensor("a", (2,), torch.float32, fails)], {"config.json": b"{}"}, 10**9)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert read_export_identity(str(out), "hf") == ident, "the complete export before it is still there"
    write_hf_dir(str(out), good, {"config.json": b"{\"v\": 2}"}, 10**9)
    assert (out / "config.json").read_text() == '{"v": 2}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "no temporary or old copy left behind"


def test_a_refusal_leads_with_what_differs_in_one_line():
    """Another model's checkpoints: the first line names the config key or LoRA setting that
    differs (not two descriptions that read the same), then at most a few lines of detail."""
    gpt = {"kind": "gpt", "config": {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 320}}
    params = {f"blocks.{i}.w": [4, 4] for i in range(9)}
    saved = {**manifest(1), "params": [{"name": "blocks.0.w", "shape": [4, 4]}], "model_source": gpt}
    with pytest.raises(CheckpointError) as e:
        check_model(saved, params, "ck", model={**gpt, "config": {**gpt["config"], "n_layer": 9}})
    lines = str(e.value).splitlines()
    assert lines[0] == ("ck holds a different model: n_layer 2 in the checkpoint, 9 here, so 8 tensors differ; train it "
                        "into another checkpoint.dir, or set checkpoint.resume=none to start from scratch beside them")
    assert len(lines) <= 7 and lines[-1] == "  … and 4 more"
    lora = {**gpt, "lora": {"r": 8, "alpha": 16}}
    with pytest.raises(CheckpointError, match=r"different model: model.lora.r 8 in the checkpoint, 16 here, so"):
        check_model({**saved, "model_source": lora}, {"blocks.0.w": [4, 2]}, "ck",
                    model={**gpt, "lora": {"r": 16, "alpha": 16}})
    with pytest.raises(CheckpointError, match=r"different model: LoRA adapters in the checkpoint, none here"):
        check_model({**saved, "model_source": lora}, {"blocks.0.w": [4, 2]}, "ck", model=gpt)
