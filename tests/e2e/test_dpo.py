"""Preference tuning through `rayzero train` as a user runs it (the CLI's `main`, on the session's
cluster): an HF Llama tuned with `train.objective=dpo` on pairs prepared with `--preferences`,
with validation on held-out pairs, checkpoints, MLflow and an HF export that `rayzero generate`
reads. The same command stopped after 2 steps and run again to 6 ends bitwise on the unbroken
run; its step-4 checkpoint goes on at world 1 to the unbroken run's weights (resharded, within
1e-5); resuming them with another reference is refused. The sharded runs against the single-process
one: tests/dist/test_dpo.py; against TRL's DPOTrainer: tests/e2e/test_dpo_trl.py."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from rayzero.objectives.dpo import PAIR_METRICS
from tests.conftest import cli_in_process
from tests.dist.test_dpo import pairs
from tests.models import save_hf_model, save_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    from rayzero.data.tokens import prepare

    root = tmp_path_factory.mktemp("dpo-e2e")
    model = save_hf_model("llama", root / "llama", seed=5)
    save_tokenizer(model, [Path(sys.modules["json"].__file__).read_text()], vocab=300)
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs(48, seed=1)))
    prepare(root / "pairs.jsonl", str(root / "data"), tokenizer=str(model), preferences=True)
    return model, root / "data"


def test_a_dpo_run_reports_trl_metrics_resumes_bitwise_and_generates(train_here, prefs, tmp_path, capsys,
                                                                     monkeypatch):
    model, data = prefs
    keys = ["model.kind=hf", f"model.path={model}", f"data.path={data}", "train.objective=dpo", "train.seq_len=40",
            "train.global_batch_size=8", "train.micro_batch_size=2", "data.val_fraction=0.1", "train.eval_every=2",
            "train.eval_batches=1", "cluster.num_workers=2", "sharding.strategy=optim_grads", "optim.lr=5e-3",
            "optim.warmup_steps=1", "optim.schedule=constant"]  # the same learning rates told 2 steps or 6
    code, _, err, straight = train_here(*keys, "train.steps=6", f"train.save_final={tmp_path / 'straight'}",
                                        "checkpoint.dir=", summary="straight.json")
    assert code == 0, err[-3000:]
    # TRL's names, in the summary, the history and MLflow; validation on the held-out pairs too
    assert set(straight["final_preferences"]) == set(PAIR_METRICS)
    assert set(straight["final_val_preferences"]) == {f"val_{k}" for k in PAIR_METRICS}
    client = MlflowClient(straight["mlflow_tracking_uri"])
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert len(client.get_metric_history(straight["mlflow_run_id"], key)) == 6, key
    val = client.get_metric_history(straight["mlflow_run_id"], "val_rewards/margins")
    assert sorted(m.step for m in val) == [-1, 1, 3, 5]
    assert [m.value for m in sorted(val, key=lambda m: m.step)][0] == 0.0, "before training: policy = reference"

    # the SDK's Result: the history holds the pair metrics, the plot the reward margin, train and validation
    from rayzero.cluster.history import load_rows
    from rayzero.sdk import Result

    result = Result(straight, load_rows(Path(straight["run_dir"]) / "history.jsonl"))
    history = result.history
    assert history["rewards/margins"].notna().sum() == 6 and history["val_rewards/margins"].notna().sum() == 4
    assert result.metrics["rewards/margins"] == straight["final_preferences"]["rewards/margins"]
    margin = next(ax for ax in result.plot(tmp_path / "plot.png").axes if ax.get_title().startswith("reward margin"))
    assert [line.get_label() for line in margin.get_lines()] == ["train", "validation"]

    resumed = [*keys, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=2",
               f"train.save_final={tmp_path / 'resumed'}", "train.save_format=hf"]
    code, _, err, _ = train_here(*resumed, "train.steps=2", summary="first.json")
    assert code == 0, err[-3000:]
    code, _, err, again = train_here(*resumed, "train.steps=6", summary="again.json")
    assert code == 0, err[-3000:]
    assert f"resuming from {tmp_path / 'ck' / 'step-000002'} at step 2 of 6" in err
    a = load_file(tmp_path / "straight")
    b = {}
    for f in (tmp_path / "resumed").glob("*.safetensors"):
        b.update(load_file(f))
    for k, v in b.items():
        assert torch.equal(v, a[k]), f"2 + 4 steps differ from 6: {k}"
    assert again["final_loss"] == straight["final_loss"]
    assert again["final_preferences"] == straight["final_preferences"]
    manifest = json.loads(next((tmp_path / "ck").glob("step-000006/manifest.json")).read_text())
    assert manifest["objective"]["reference"]["kind"] == "frozen_copy", "the reference is named, not stored"
    assert not any("ref" in p["name"] for p in manifest["params"])

    # the result is a model like any other: generate reads the export
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(tmp_path / "resumed"), "--prompt",
                                    "Q: import os\nA:", "--max-new-tokens", "6", "--raw")
    assert code == 0 and out.startswith("Q: import os"), err

    # resharded: the step-4 checkpoint goes on to step 6 at world 1, to the 2-rank run's weights within 1e-5
    shutil.copytree(tmp_path / "ck" / "step-000004", tmp_path / "ck1" / "step-000004")
    code, _, err, _ = train_here(*keys, "cluster.num_workers=1", f"checkpoint.dir={tmp_path / 'ck1'}", "train.steps=6",
                                 f"train.save_final={tmp_path / 'six-1'}", summary="six1.json")
    assert code == 0 and "at step 4 of 6" in err, err[-3000:]
    one = load_file(tmp_path / "six-1")
    for k, v in a.items():
        assert torch.allclose(one[k], v, rtol=1e-5, atol=1e-6), k

    # another reference (ORPO has none) cannot resume these checkpoints: the rewards would mean another thing
    code, _, err, _ = train_here(*resumed, "train.steps=8", "dpo.loss=orpo", summary="orpo.json")
    assert code != 0 and "reference model (frozen_copy" in err and "is not this run's (none)" in err, err[-2000:]


def test_every_kind_of_reference_resumes_by_running_its_command_again(train_here, prefs, tmp_path, capsys,
                                                                       monkeypatch):
    """The base with the adapters off (LoRA, under ZeRO-3) and no reference at all (ORPO) — a
    frozen copy above, language modelling everywhere: 2 steps, then the same command told 3
    resumes its own checkpoint, and its dry run says so first. Every configuration of the
    generator, without training: tests/unit/test_resume_records.py."""
    model, data = prefs
    keys = ["model.kind=hf", f"model.path={model}", f"data.path={data}", "train.objective=dpo", "train.seq_len=40",
            "train.global_batch_size=8", "train.micro_batch_size=2", "cluster.num_workers=2", "optim.warmup_steps=1",
            "tracking.enabled=false", "checkpoint.every_steps=2"]
    for kind, extra in (("adapters_off", ["model.lora.r=4", "model.lora.alpha=8", "sharding.strategy=optim_grads_params"]),
                        (None, ["dpo.loss=orpo"])):
        args = [*keys, *extra, f"checkpoint.dir={tmp_path / str(kind)}"]
        code, _, err, _ = train_here(*args, "train.steps=2", summary=f"{kind}-first.json")
        assert code == 0, err[-3000:]
        manifest = json.loads((tmp_path / str(kind) / "step-000002" / "manifest.json").read_text())
        assert (manifest["objective"]["reference"] or {}).get("kind") == kind
        if kind:  # the dry run of the command (the record a LoRA-DPO run once refused)
            code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", *args, "train.steps=3")
            assert code == 0 and f"resuming from {tmp_path / kind / 'step-000002'} at step 2 of 3" in out, err
        code, _, err, again = train_here(*args, "train.steps=3", summary=f"{kind}-again.json")
        assert code == 0, err[-3000:]
        assert again["start_step"] == 2 and again["steps"] == 1, kind
