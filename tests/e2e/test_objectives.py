"""A user's own objective through `rayzero train` as a user runs it (the CLI's `main`, on the
session's cluster): the guide's label smoothing (`examples/objectives.py`, copied into the run's
working directory as a user's file) trains a GPT on 2 ranks with validation and checkpoints; its
metrics reach MLflow, the history and the summary, merged as they declare; its plain NLL at the
first step equals next-token's loss on the same weights and batch; rerunning the command resumes
from its commit, another `train.objective_kwargs` is refused there; one with a reference model
(the guide's `StayClose`) reads the frozen starting weights' log-probabilities, its KL term 0 at
the first step; and a class without a loss is refused in one line before the cluster is
touched."""

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import cli_in_process

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "objectives.py"
KEYS = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "train.seq_len=64", "train.global_batch_size=8",
        "train.micro_batch_size=2", "optim.warmup_steps=2", "data.val_fraction=0.1", "train.eval_every=2",
        "train.eval_batches=1"]


def test_a_label_smoothing_objective_of_ones_own_trains_reports_and_resumes(train_here, small_dataset, tmp_path,
                                                                            capsys, monkeypatch):
    shutil.copy(EXAMPLE, tmp_path / "my_objectives.py")
    keys = [*KEYS, f"data.path={small_dataset}", "train.objective=my_objectives:LabelSmoothing",
            "train.objective_kwargs.epsilon=0.1", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=2"]
    code, _, err, s = train_here(*keys, "train.steps=2", summary="ls.json")
    assert code == 0, err[-3000:]
    # its metrics, merged over the ranks as declared: nll the mean over the step's valid targets,
    # max_token_nll the largest; in the summary, the history and MLflow, train and validation
    assert set(s["final_objective"]) == {"nll", "max_token_nll"}
    assert set(s["final_val_objective"]) == {"val_nll", "val_max_token_nll"}
    client = MlflowClient(s["mlflow_tracking_uri"])
    nll = [m.value for m in sorted(client.get_metric_history(s["mlflow_run_id"], "nll"), key=lambda m: m.step)]
    loss = [m.value for m in sorted(client.get_metric_history(s["mlflow_run_id"], "loss"), key=lambda m: m.step)]
    assert len(nll) == len(loss) == 2 and all(a > b for a, b in zip(loss, nll)), (loss, nll)  # smoothing adds
    assert s["final_objective"]["max_token_nll"] > s["final_objective"]["nll"]
    assert not client.get_metric_history(s["mlflow_run_id"], "val_perplexity")  # its loss is no plain NLL

    # the same weights and batch under next-token prediction: its loss is the objective's nll
    code, _, err, lm = train_here(*KEYS, f"data.path={small_dataset}", "train.steps=1", "checkpoint.dir=",
                                  "tracking.enabled=false", summary="lm.json")
    assert code == 0, err[-3000:]
    assert lm["first_loss"] == pytest.approx(nll[0], rel=1e-6)

    # the same command to 3 steps resumes its commit; another epsilon is refused there, in one line
    code, _, err, again = train_here(*keys, "train.steps=3", "tracking.enabled=false", summary="again.json")
    assert code == 0, err[-3000:]
    assert f"resuming from {tmp_path / 'ck' / 'step-000002'} at step 2 of 3" in err
    assert again["steps"] == 1 and set(again["final_objective"]) == {"nll", "max_token_nll"}
    code, _, err, _ = train_here(*[k.replace("epsilon=0.1", "epsilon=0.2") for k in keys], "train.steps=4",
                                 "tracking.enabled=false")
    assert code == 2, err[-2000:]
    assert "its objective's kwargs.epsilon is 0.1 in the checkpoint, 0.2 here" in err

    # with a reference (the starting weights, frozen): at the first step the policy is its
    # reference, so the KL term is 0 and the loss is the plain NLL; after, the KL grows
    code, _, err, close = train_here(*KEYS, f"data.path={small_dataset}", "train.objective=my_objectives:StayClose",
                                     "train.steps=3", "optim.lr=1e-2", "checkpoint.dir=", summary="close.json")
    assert code == 0, err[-3000:]
    rows = {m: [x.value for x in sorted(MlflowClient(close["mlflow_tracking_uri"]).get_metric_history(
        close["mlflow_run_id"], m), key=lambda x: x.step)] for m in ("loss", "nll", "kl")}
    assert rows["kl"][0] == 0.0 and rows["loss"][0] == pytest.approx(rows["nll"][0], rel=1e-6), rows
    assert rows["kl"][-1] > 0, rows
    assert close["memory"]["reference_bytes"] > 0  # the frozen copy, beside the model state

    # its dry run says what the run trains for
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", *KEYS,
                                    f"data.path={small_dataset}", "train.objective=my_objectives:StayClose",
                                    "train.objective_kwargs.beta=0.2", "checkpoint.dir=")
    assert code == 0, err
    assert ("objective my_objectives:StayClose (beta=0.2); metrics: nll, kl; reference: a frozen copy of the "
            "starting weights in fp32, ") in out and " MiB per rank" in out, out

    # a class that is no objective: refused before the cluster is touched, in one line
    (tmp_path / "broken.py").write_text("from rayzero.objectives import Objective\n\nclass NoLoss(Objective):\n"
                                        "    pass\n")
    code, out, err, _ = train_here(*KEYS, f"data.path={small_dataset}", "train.objective=broken:NoLoss",
                                   "checkpoint.dir=", "tracking.enabled=false")
    assert code == 2 and "train.objective: broken:NoLoss defines no loss(self, out, batch)" in err, err[-2000:]
    assert "placing" not in err.split("defines no loss")[0].split("\n")[-1]
