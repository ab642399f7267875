"""Reward functions (`rayzero/rollout/rewards.py`) as TRL's `GRPOTrainer._calculate_rewards`
calls them (its own code, run here): the same keyword arguments, None as NaN, the weighted sum;
the built-in format reward equal to TRL's `think_format_reward`; a reward named by file path or
module; one that raises, returns the wrong count, or does not import, said in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from rayzero.rollout.rewards import RewardError, Rewards, format as format_reward, load  # noqa: E402

PROMPTS = ["2+3=", "2+3=", "7-1=", "7-1="]
COMPLETIONS = ["<think>add</think>5", "4", "<think>sub</think>6", "<think>x"]
COLUMNS = {"answer": ["5", "5", "6", "6"], "level": [1, 1, 2, 2]}


def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.endswith(a) else 0.0 for c, a in zip(completions, answer)]


def picky(prompts, completions, level, **kwargs):  # declines to score level 2
    return [0.5 * len(c) if lv == 1 else None for c, lv in zip(completions, level)]


def trl_rewards(funcs, weights):
    from trl.trainer.grpo_trainer import GRPOTrainer

    this = SimpleNamespace(accelerator=SimpleNamespace(device="cpu", gather=lambda x: x, is_main_process=True),
                           reward_funcs=funcs, reward_processing_classes=[None] * len(funcs),
                           reward_func_names=[f.__name__ for f in funcs], state=SimpleNamespace(global_step=0),
                           args=SimpleNamespace(report_to=[]), environments=None,
                           _log_completion_extra=None, _log_metric=None)
    inputs = [{"prompt": p, "answer": a, "level": lv} for p, a, lv in zip(PROMPTS, *COLUMNS.values())]
    per_func = GRPOTrainer._calculate_rewards(this, inputs, PROMPTS, COMPLETIONS, [[1]] * 4)
    return per_func, (per_func * torch.tensor(weights).unsqueeze(0)).nansum(1)


def test_rewards_are_scored_and_weighted_as_trl_does():
    funcs, weights = [exact, picky], [1.0, 0.5]
    per_func, total = Rewards(funcs, weights).score(PROMPTS, COMPLETIONS, [[1]] * 4, COLUMNS)
    want_per, want_total = trl_rewards(funcs, weights)
    assert torch.equal(per_func.isnan(), want_per.isnan())
    assert torch.allclose(per_func.nan_to_num(), want_per.nan_to_num()) and torch.allclose(total, want_total)
    assert per_func[2, 1].isnan() and not total[2].isnan()  # one function declined, the other scored


def test_the_format_reward_is_trls():
    from trl.rewards import think_format_reward

    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert format_reward(completions) == think_format_reward(completions)
    assert format_reward(COMPLETIONS) == [1.0, 0.0, 1.0, 0.0]  # standard prompts: strings


def test_a_reward_by_path_or_module_and_what_is_refused(tmp_path):
    (tmp_path / "mine.py").write_text("def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n"
                                      "NOT_A_FUNCTION = 3\n")
    fn = load(f"{tmp_path / 'mine.py'}:length")
    assert fn(completions=["ab", "c"]) == [2.0, 1.0]
    assert load("tests.unit.test_rewards:exact") is exact and load("format") is format_reward
    with pytest.raises(ValueError, match="cannot import .*no file"):
        load(f"{tmp_path / 'none.py'}:length")
    with pytest.raises(ValueError, match="NOT_A_FUNCTION is a int, not a function"):
        load(f"{tmp_path / 'mine.py'}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="expected accuracy, format, path/to/file.py:function"):
        load("nope")

    def broken(prompts, completions, **kw):
        if any(c == COMPLETIONS[2] for c in completions):
            raise KeyError("solution")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward broken failed on prompt 9 \(completion 2 of the round\): "
                                          r"KeyError: 'solution'"):
        Rewards([broken]).score(PROMPTS, COMPLETIONS, [[1]] * 4, COLUMNS, prompt_index=[8, 8, 9, 9])
    with pytest.raises(RewardError, match="returned 1 rewards for 4 completions"):
        Rewards([lambda **kw: [1.0]]).score(PROMPTS, COMPLETIONS, [[1]] * 4, COLUMNS)
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        Rewards([exact], [1.0, 2.0])


def test_the_accuracy_reward_is_trls():
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    from rayzero.rollout.rewards import accuracy

    solutions = [r"\frac{1}{3}", r"\frac{1}{3}", "5", "not math at all {{"]
    contents = [r"So \boxed{\frac{1}{3}}", r"It is \boxed{\frac{1}{2}}", r"$5$", "5"]
    completions = [[{"role": "assistant", "content": c}] for c in contents]
    want = accuracy_reward(completions, solutions)
    assert accuracy(completions, solutions) == want == accuracy(contents, solutions)
    assert want[:2] == [1.0, 0.0]
