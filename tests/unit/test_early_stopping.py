"""Early stopping (`train.early_stopping_patience`), the best checkpoint kept under rotation
(`checkpoint.keep_best`), and each run's own checkpoints in a shared directory."""

import pytest

from rayzero.checkpoint.manifest import best_commit, committed, prune, step_dir, write_manifest
from rayzero.storage import Storage
from rayzero.cluster.early_stopping import EarlyStopping


def test_it_stops_after_patience_evaluations_without_improvement():
    e = EarlyStopping(patience=2, min_delta=0.05)
    seen = [(-1, 5.0), (1, 4.0), (3, 3.98), (5, 3.9), (7, 3.97), (9, 3.88)]
    # 3.98 is within 0.05 of 4.0 (no improvement), 3.9 is not (a new best); 3.97 and 3.88 are not below 3.85
    assert [e.observe(s, v) for s, v in seen] == [False, False, False, False, False, True]
    assert (e.best, e.best_step, e.since_best, e.stopped_after) == (3.9, 5, 2, 9)
    assert "no improvement on the validation loss 3.9000 (after step 5) by more than 0.05 in 2 evaluations" in e.stopped


def test_its_state_carries_over_a_resume_and_says_when_the_next_evaluation_may_stop():
    e = EarlyStopping(patience=3)
    for s, v in [(1, 2.0), (3, 2.5), (5, 2.4)]:
        e.observe(s, v)
    assert e.may_stop_next()
    resumed = EarlyStopping(patience=3)
    resumed.restore(e.state())
    assert resumed.observe(7, 2.1) and resumed.best == 2.0
    never = EarlyStopping(patience=0)
    assert not any(never.observe(s, 9.0 + s) for s in range(10)) and not never.may_stop_next()


def manifest(step, val=None, lineage="a"):
    m = {"format": "rayzero-checkpoint", "version": 1, "step": step, "shards": [], "params": [],
         "run": {"lineage": lineage}}
    if val is not None:
        m["metrics"] = {"val_loss": val}
    return m


def test_the_best_checkpoint_survives_rotation(tmp_path):
    root = Storage(str(tmp_path))
    for step, val in [(2, 3.0), (4, 2.5), (6, 2.7), (8, 2.9)]:
        write_manifest(root.child(step_dir(step)), manifest(step, val))
        prune(root, keep_last=1, own={"a"}, keep_best="val_loss")
    assert [c.step for c in committed(root)] == [4, 8]  # the last, and the best
    assert best_commit(committed(root)).step == 4
    write_manifest(root.child(step_dir(10)), manifest(10, 2.0))
    assert sorted(prune(root, keep_last=1, own={"a"}, keep_best="val_loss")) == [step_dir(4), step_dir(8)]
    assert [c.step for c in committed(root)] == [10]


def test_pruning_leaves_other_runs_checkpoints_alone(tmp_path):
    """`checkpoint.resume=none` in a directory another run (another model) also uses: each run
    rotates only its own commits, whatever their steps."""
    root = Storage(str(tmp_path))
    for step in (100, 150):
        write_manifest(root.child(step_dir(step)), manifest(step, lineage="old"))
    for step in (10, 20, 30):
        write_manifest(root.child(step_dir(step)), manifest(step, lineage="new"))
        prune(root, keep_last=2, own={"new"})
    assert [c.step for c in committed(root)] == [20, 30, 100, 150]


def test_throughput_per_rank_and_mfu_where_the_peak_is_known():
    from rayzero.cluster.throughput import peak_flops, throughput

    t = throughput(8000.0, 4, 6e9, "NVIDIA H100 80GB HBM3")
    assert t["tokens_per_s_per_rank"] == 2000.0 and t["model_flops_per_s_per_rank"] == 1.2e13
    assert t["mfu"] == pytest.approx(1.2e13 / 989.4e12)
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H200") == 989.4e12
    assert throughput(8000.0, 4, 6e9, "cpu")["mfu"] is None  # no published peak: none made up
    assert peak_flops("NVIDIA A10G") is None


def test_model_flops_per_token_are_6n_plus_attention():
    from rayzero.config import load_config
    from rayzero.workers.assembly import make_spec

    cfg = load_config(None, ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64"])
    spec = make_spec(cfg)
    model = spec.build()
    n = sum(p.numel() for p in model.parameters())
    assert spec.flops_per_token(model, 64) == 6 * n + 12 * 2 * 64 * 64
