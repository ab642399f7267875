"""Pipeline parallelism through `rayzero train` as a user runs it (the CLI's `main`, on the
session's cluster, each iteration one compiled graph whose pipeline phase runs the schedule):
the built-in GPT, its head tied to its embedding, at pp 2 with validation, checkpoints and an
export. The same command stopped after 2 steps and run again to 4 ends bitwise on the unbroken
run's weights, and so does the run whose last stage's rank is lost (a warm spare takes its
place); the run equals a pp 1 x dp 2 run of the same config within 1e-5.

The schedules, strategies, TP and the checkpoints across pipeline sizes against a single-process
reference: tests/dist/test_pipeline.py and tests/dist/test_pipeline_checkpoints.py."""

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.faults import OnceMarker, controller_run, weights_equal

pytestmark = pytest.mark.slow


class LastStageDiesOnce(OnceMarker):
    """The rank holding the last stage dies once, at step 3 (after the step-2 commit)."""

    def step(self, prev):
        if self.rank.plan["step"] == 3 and self.rank.mesh.coord("pp") == 1 and self._first_time("die"):
            os._exit(1)
        return super().step(prev)


def test_a_pipelined_run_trains_resumes_bitwise_takes_a_spare_and_equals_data_parallel(
        train_here, ray_cluster, small_dataset, tmp_path):
    """One unbroken pp 2 run of 4 steps, and three runs that must end on its weights: the same
    command stopped after 2 steps and run again to 4 (bitwise); the run with the rank of its last
    stage lost at step 3, a warm spare taking its coordinates (stage and all) and the group
    resuming from its last commit (bitwise); a pp 1 x dp 2 run (within 1e-5)."""
    keys = [f"data.path={small_dataset}", "model.n_layer=4", "model.n_embd=64", "model.n_head=4", "train.seq_len=32",
            "train.global_batch_size=8", "train.micro_batch_size=2", "data.val_fraction=0.05", "train.eval_every=2",
            "train.eval_batches=1", "tracking.enabled=false", "cluster.num_workers=2", "optim.warmup_steps=1",
            "optim.schedule=constant"]  # the same learning rates whether a run is told 2 steps or 4
    pp = [*keys, "parallel.pp=2", "parallel.pp_schedule=1f1b"]

    code, out, err, straight = train_here(*pp, "train.steps=4", f"train.save_final={tmp_path / 'straight'}",
                                          "checkpoint.dir=", summary="straight.json")
    assert code == 0, err[-3000:]
    assert straight["pp"] == 2 and len(straight["stages"]) == 2
    assert "2 ranks, strategy optim, pipeline 2 stages (1f1b), " in out, "the summary names the pipeline"
    assert [v[0] for v in straight["val_losses"]] == [-1, 1, 3]

    resumed = [*pp, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=2",
               f"train.save_final={tmp_path / 'resumed'}"]
    code, _, err, _ = train_here(*resumed, "train.steps=2", summary="first.json")
    assert code == 0, err[-3000:]
    code, _, err, again = train_here(*resumed, "train.steps=4", summary="again.json")
    assert code == 0, err[-3000:]
    assert f"resuming from {tmp_path / 'ck' / 'step-000002'} at step 2 of 4" in err
    a, b = load_file(tmp_path / "straight"), load_file(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "2 + 2 steps differ from 4"
    assert again["final_loss"] == straight["final_loss"] and again["final_val_loss"] == straight["final_val_loss"]

    # The last stage's rank lost: a spare (its own half CPU) takes its place, and the run goes on from the commit.
    (tmp_path / "struck").mkdir()
    controller, error = controller_run(tmp_path / "struck", ray_cluster, small_dataset, LastStageDiesOnce, *pp,
                                       "train.steps=4", "checkpoint.every_steps=2", "failure.spares=1",
                                       "cluster.cpus_per_worker=0.5")
    assert error is None, error
    (f,) = controller.failures
    assert (f.rank, f.decision) == (1, "replace")
    assert weights_equal(tmp_path / "struck" / "final.safetensors", tmp_path / "straight")

    code, _, err, dp = train_here(*keys, "train.steps=4", f"train.save_final={tmp_path / 'dp'}", "checkpoint.dir=",
                                  summary="dp.json")
    assert code == 0, err[-3000:]
    c = load_file(tmp_path / "dp")
    assert a.keys() == c.keys()
    for k in a:
        assert torch.allclose(a[k], c[k], rtol=1e-5, atol=1e-6), k
    for key in ("first_loss", "final_loss", "final_val_loss"):
        assert straight[key] == pytest.approx(dp[key], rel=1e-5), key
    assert straight["num_params"] == dp["num_params"], "the tied weight counted once"
    assert straight["model_flops_per_token"] == pytest.approx(dp["model_flops_per_token"], rel=1e-9)
