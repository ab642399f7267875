"""The objective seam (`rayzero/objectives/`): no objective's name is tested outside it, an
objective's metrics merge as they declare and a key or a metric nobody declared is an error, a
micro-batch carries an objective's own fields through a cp split, and a user's class is refused
in one line when it lacks what the interface needs. Pure functions; the runs through the CLI:
tests/e2e/test_objectives.py, every objective on every axis bitwise as before the seam:
tests/dist/fingerprint.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import rayzero
from rayzero.config import load_config
from rayzero.data.microbatch import MicroBatch
from rayzero.objectives.base import Metric, Objective, metric_sums
from rayzero.objectives.config import OBJECTIVES
from rayzero.objectives.registry import check_class, objective_difference, objective_for, objective_record
from rayzero.sharding.context_parallel import split
from rayzero.step_report import FIELDS, merge

ROOT = Path(rayzero.__file__).resolve().parent


def named_objectives(source: str) -> list[int]:
    """The lines that hold a built-in objective's name as a string (other than the default `lm`
    of the config's field, which names no behaviour)."""
    names = set(OBJECTIVES) - {"lm"}
    found = [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and n.value in names]
    found += [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Compare)
              and any(isinstance(c, ast.Constant) and c.value == "lm" for s in (n.left, *n.comparators)
                      for c in ast.walk(s))]
    return found


def test_no_objective_is_named_outside_objectives():
    files = [f for f in sorted(ROOT.rglob("*.py")) if ROOT / "objectives" not in f.parents]
    assert [f"{f.relative_to(ROOT.parent)}:{line}" for f in files for line in named_objectives(f.read_text())] == []


def test_the_check_sees_a_name_tested_or_passed():
    assert named_objectives('if cfg.train.objective == "dpo": pass\nx = {"dpo": 1}\nif o != "lm": pass\n'
                            'default = "lm"\n') == [1, 2, 3]


def test_a_step_report_key_nobody_declared_is_an_error():
    report = {"rank": 0, "step": 1, "loss_sum": 1.0, "tokens": 2}
    assert merge([report, {**report, "rank": 1}])["tokens"] == 4
    with pytest.raises(ValueError, match="prefs .*declare each in rayzero/step_report.py"):
        merge([{**report, "prefs": {"x": 1.0}}])
    assert "objective" in FIELDS and "val_objective" in FIELDS


def test_objective_metrics_merge_as_declared_in_any_grouping():
    ranks = [{"rank": r, "objective": {"sum": {"a": float(r + 1), "n": 2.0}, "max": {"m": float(10 - r)}}}
             for r in range(4)]
    flat = merge(ranks)["objective"]
    nodes = merge([merge(ranks[:3]), merge(ranks[3:])])["objective"]
    assert flat == nodes == {"sum": {"a": 10.0, "n": 8.0}, "max": {"m": 10.0}}

    class Mine(Objective):
        metrics = (Metric("a", "mean"), Metric("per_n", "mean", over="n"), Metric("n", "sum", shown=False),
                   Metric("m", "max"))

    o = Mine(load_config(None, []))
    sums = {"sum": {"a": 10.0, "per_n": 4.0, "n": 8.0}, "max": {"m": 10.0}}
    assert o.step_metrics(sums, count=5.0, prefix="val_") == {"val_a": 2.0, "val_per_n": 0.5, "val_m": 10.0}
    with pytest.raises(ValueError, match="returned the metric 'b', which its `metrics` do not declare"):
        metric_sums(o, {"b": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="`over` is for merge=mean"):
        Metric("x", "max", over="n")


def test_a_micro_batch_keeps_row_fields_whole_and_splits_token_fields_with_cp():
    class CP:
        def split(self, t, dim=1):
            return split(t, 2, 1, dim)

    tokens = torch.arange(16).view(2, 8)
    b = MicroBatch(tokens, tokens + 1).with_fields(rows={"weight": torch.tensor([0.5, 2.0])},
                                                   tokens={"old_logps": -tokens.float()})
    part = b.split(CP())
    assert torch.equal(part.row_fields["weight"], b.row_fields["weight"])
    assert torch.equal(part.token_fields["old_logps"], -part.tokens.float())  # the same tokens as the ids
    assert part.loss_mask.all() and part.example_ids is None
    with pytest.raises(ValueError, match="token field 'w': shape \\(2, 7\\)"):
        b.with_fields(tokens={"w": torch.zeros(2, 7)})


def test_a_users_class_is_refused_in_one_line_when_it_lacks_the_interface():
    class NoLoss(Objective):
        pass

    class OddKind(Objective):
        data_kinds = ("rollouts",)

        def loss(self, out, batch):
            return out.token_logps.sum(), {}

    with pytest.raises(ValueError, match="defines no loss"):
        check_class(NoLoss, "m:NoLoss")
    with pytest.raises(ValueError, match="not a subclass of rayzero.objectives.Objective"):
        check_class(len, "m:len")
    with pytest.raises(ValueError, match="data_kinds names 'rollouts'"):
        check_class(OddKind, "m:OddKind")


def test_the_built_in_objectives_records_are_as_before_and_kwargs_are_checked_on_resume(tmp_path):
    assert objective_record(load_config(None, []), None) == {"name": "lm"}  # what older checkpoints hold
    dpo = load_config(None, ["train.objective=dpo", "train.micro_batch_size=2"])
    assert objective_record(dpo, {"kind": "gpt"}) == {"name": "dpo", "loss": "sigmoid",
                                                      "reference": {"kind": "frozen_copy", "model": {"kind": "gpt"}}}
    (tmp_path / "scaled_mine.py").write_text("from rayzero.objectives import Objective\n"
                                      "class Mine(Objective):\n"
                                      "    def __init__(self, cfg, scale=1.0):\n"
                                      "        super().__init__(cfg); self.scale = scale\n"
                                      "    def loss(self, out, batch):\n"
                                      "        return self.scale * out.token_logps.sum(), {}\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        a = load_config(None, ["train.objective=scaled_mine:Mine", "train.objective_kwargs.scale=2"])
        b = load_config(None, ["train.objective=scaled_mine:Mine", "train.objective_kwargs.scale=3"])
        assert objective_for(a).scale == 2
        why = objective_difference(objective_record(a, None), objective_record(b, None))
        assert why.startswith("its objective's kwargs.scale is 2 in the checkpoint, 3 here")
        assert objective_difference(objective_record(a, None), objective_record(a, None)) is None
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(Exception, match="train.objective_kwargs: for an objective of your own"):
        load_config(None, ["train.objective=dpo", "train.micro_batch_size=2", "train.objective_kwargs.x=1"])


def test_the_guides_label_smoothing_is_torchs():
    """examples/objectives.py's LabelSmoothing, on logits and targets with a masked one: torch's
    `cross_entropy(label_smoothing=0.1)`, summed over the valid targets."""
    import torch.nn.functional as F

    from examples.objectives import LabelSmoothing
    from rayzero.objectives.base import Output

    class Spec:  # the model seam's part an Output reads: no auxiliary loss
        def aux_loss(self, raw):
            return None

    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    targets[0, 0] = -100
    batch = MicroBatch(torch.zeros(2, 5, dtype=torch.long), targets)
    loss, metrics = LabelSmoothing(load_config(None, []), epsilon=0.1).loss(Output(Spec(), logits, logits, batch), batch)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1, reduction="sum")
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert metrics["nll"].item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                                  reduction="sum").item(), rel=1e-6)
