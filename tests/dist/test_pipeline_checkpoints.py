"""Checkpoints of pipeline stages on real gloo groups: saved by the ranks, committed by the
controller's `Checkpoints`, read back by `Rank.load_checkpoint` + `apply_checkpoint`.

The built-in GPT (4 blocks, its head tied to its embedding) on 2 ranks: as 2 stages (pp 2,
1f1b), as 2 ranks of 2 interleaved stages each (one block per stage), or as 2 data-parallel
ranks (pp 1 x dp 2, ZeRO-1). Data, learning rate and dropout's draws are functions of the step,
so a run resumed at step 4 sees what the unbroken run saw: at the same layout it ends bitwise
equal to 8 straight steps, across layouts within 1e-5 (sums in another order).
"""

import pytest
import torch

from rayzero.checkpoint.manifest import open_checkpoint
from tests.dist.ckpt_helpers import config, run
from tests.dist.reference import rel_error

STEPS, SAVE = 8, 4
LAYOUTS = {"pp2": ["parallel.pp=2"], "pp1dp2": [],
           "pp2x2": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"]}


def layout_config(layout: str, root: str, extra=()):
    # 4 rows of micro-batch 1 per step: 4 micro-batches through the 2 stages, 2 per dp rank
    return config(2, "optim", root, ["model.n_layer=4", "train.global_batch_size=4", *LAYOUTS[layout], *extra])


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, small_dataset) -> dict[str, dict]:
    """8 straight steps at pp 2 and at pp 1 x dp 2."""
    root = str(tmp_path_factory.mktemp("unused"))
    return {layout: run(layout_config(layout, root), small_dataset, 0, STEPS) for layout in ("pp2", "pp1dp2")}


def save_then_resume(written: str, resumed: str, root: str, data_path: str, extra=()) -> tuple[dict, dict]:
    first = run(layout_config(written, root, extra), data_path, 0, SAVE, save_at=SAVE)
    c = open_checkpoint(first["committed"])
    assert c.step == SAVE
    stages = c.manifest["layout"].get("stages")
    if written != "pp1dp2":  # each pipeline rank's layout, each shard in its own rank's
        assert [s["pp_rank"] for s in stages] == [0, 1]
        assert sorted(s["pp_rank"] for s in c.manifest["shards"]) == [0, 1]
    else:
        assert stages is None
    return first, run(layout_config(resumed, root, extra), data_path, SAVE, STEPS, resume=(c.uri, c.manifest))


def test_resume_at_pp2_is_bitwise_identical(tmp_path, small_dataset, unbroken):
    dropout = ["model.dropout=0.1"]  # each stage's masks drawn by (step, micro-batch, stage)
    straight = run(layout_config("pp2", str(tmp_path / "unused"), dropout), small_dataset, 0, STEPS)
    assert straight["losses"][0] != unbroken["pp2"]["losses"][0], "dropout must draw for the test to mean anything"
    first, resumed = save_then_resume("pp2", "pp2", str(tmp_path / "ckpt"), small_dataset, dropout)
    assert first["losses"] == straight["losses"][:SAVE]
    assert resumed["losses"] == straight["losses"][SAVE:]
    assert resumed["state"].keys() == straight["state"].keys()
    for name, ref in straight["state"].items():
        assert torch.equal(resumed["state"][name], ref), name


@pytest.mark.slow
@pytest.mark.parametrize("written, resumed", [("pp2", "pp1dp2"), ("pp1dp2", "pp2"), ("pp2x2", "pp2")])
def test_resume_across_pipeline_layouts(written, resumed, tmp_path, small_dataset, unbroken):
    straight = unbroken["pp2"]
    _, got = save_then_resume(written, resumed, str(tmp_path / "ckpt"), small_dataset)
    assert got["losses"] == pytest.approx(straight["losses"][SAVE:], rel=1e-5)
    assert got["state"].keys() == straight["state"].keys()
    for name, ref in straight["state"].items():
        err = rel_error(got["state"][name], ref)
        assert err <= 1e-5, f"{written} -> {resumed}, {name}: {err:.2e}"


@pytest.mark.slow
def test_export_at_pp2_is_the_whole_model(tmp_path, small_dataset, unbroken):
    """Rank 0's `full_state_dict` at pp 2 holds every stage's weights under the model's own
    names (the tied head under both): the initial weights bitwise those of pp 1, the trained
    ones within 1e-5."""
    root = str(tmp_path / "unused")
    start = {layout: run(layout_config(layout, root), small_dataset, 0, 0)["state"] for layout in LAYOUTS}
    assert start["pp2"].keys() == start["pp1dp2"].keys()
    assert {"wte.weight", "lm_head.weight", "blocks.0.attn.qkv.weight", "blocks.3.mlp.fc.weight",
            "ln_f.weight"} <= start["pp2"].keys()
    for name, ref in start["pp1dp2"].items():
        assert torch.equal(start["pp2"][name], ref), name
    trained, ref_state = unbroken["pp2"]["state"], unbroken["pp1dp2"]["state"]
    assert trained.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert rel_error(trained[name], ref) <= 1e-5, name
    assert unbroken["pp2"]["losses"] == pytest.approx(unbroken["pp1dp2"]["losses"], rel=1e-5)
