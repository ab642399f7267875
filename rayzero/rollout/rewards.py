"""Rewards for online RL: the user's Python functions with TRL's signature, weighted, as
`GRPOTrainer` calls them.

    fn(prompts=[...], completions=[...], completion_ids=[[...]], **columns) -> [float | None, ...]

one value per completion, `None` for "cannot score" (a NaN that takes no part in its group's
baseline; a completion no function scores gets advantage 0). `columns` are the prompt records'
other fields (`rayzero data prepare --prompts` keeps them), one value per completion, repeated over
its group. A conversational prompt's completions are lists of one assistant message, as TRL gives
them; a standard prompt's are strings.

A reward is named `path/to/file.py:fn` or `package.module:fn` (as `model.factory` names a
factory), or is a callable given from Python; `accuracy` (a verifiable math answer through
math-verify, as TRL's `accuracy_reward`) and `format` (`<think>...</think>` then the answer, as
TRL's `think_format_reward`) are built in. A function that raises is reported in one line naming
it, the completion's prompt and the exception (`RewardError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from rayzero._imports import import_path


class RewardError(RuntimeError):
    """A reward function that failed: its name, the prompt it failed on, the exception. `step`:
    the step whose rollouts it scored (set by the driver's side), for the run's last line."""

    doing = "scoring the rollouts"
    step: int | None = None


def accuracy(completions, solution, **kwargs) -> list[float | None]:
    """1 where the completion's answer (LaTeX, `\\boxed{}` first) equals the record's `solution`
    under math-verify, else 0; None where the solution itself does not parse (TRL's
    `accuracy_reward`)."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise RewardError("the accuracy reward needs math-verify: pip install 'rayzero[rl]'") from None
    out: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        content = completion[0]["content"] if isinstance(completion, list) else completion
        gold = parse(sol)
        if not gold:
            out.append(None)
            continue
        answer = parse(content, extraction_config=[LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
            try_extract_without_anchor=False)], extraction_mode="first_match")
        out.append(float(verify(gold, answer)))
    return out


THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def format(completions, **kwargs) -> list[float]:  # noqa: A001 (the reward's name, as users write it)
    """1 where the completion is `<think>...</think>` and then its answer, else 0 (TRL's
    `think_format_reward`)."""
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if THINK.match(text) else 0.0 for text in contents]


BUILT_IN = {"accuracy": accuracy, "format": format}


def load(name: str) -> Callable:
    """A reward by name: a built-in one, `path/to/file.py:fn` or `package.module:fn`; ValueError in
    one line saying what failed."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"reward {name!r}: expected {', '.join(BUILT_IN)}, path/to/file.py:function or "
                         "package.module:function")
    fn = import_path(name, f"reward {name}")
    if not callable(fn):
        raise ValueError(f"reward {name}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def name_of(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@dataclass
class Rewards:
    """The run's reward functions and their weights (1 each by default)."""

    funcs: list[Callable]
    weights: list[float] | None = None

    def __post_init__(self):
        if not self.funcs:
            raise ValueError("grpo.reward_funcs: at least one reward function")
        if self.weights is None:
            self.weights = [1.0] * len(self.funcs)
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"grpo.reward_weights: {len(self.weights)} weights for {len(self.funcs)} reward functions")

    @property
    def names(self) -> list[str]:
        return [name_of(f) for f in self.funcs]

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]],
              columns: dict[str, list], prompt_index: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(each function's rewards [N, F], NaN where it declined; the weighted sum [N], NaN where
        no function scored), as TRL's `_calculate_rewards` makes them. `prompt_index`: each
        row's prompt's place in the data, for the words of an error."""
        n = len(prompts)
        per_func = torch.zeros(n, len(self.funcs), dtype=torch.float32)
        for i, fn in enumerate(self.funcs):
            try:
                got = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as e:  # noqa: BLE001 (the user's function: its own exception, in one line)
                raise self._failed(fn, e, prompts, completions, completion_ids, columns, prompt_index) from e
            got = list(got)
            if len(got) != n:
                raise RewardError(f"reward {name_of(fn)} returned {len(got)} rewards for {n} completions (one each)")
            per_func[:, i] = torch.tensor([float("nan") if r is None else float(r) for r in got], dtype=torch.float32)
        weights = torch.tensor(self.weights, dtype=torch.float32)
        total = (per_func * weights.unsqueeze(0)).nansum(1)
        total[torch.isnan(per_func).all(1)] = float("nan")
        return per_func, total

    @staticmethod
    def _failed(fn, e: Exception, prompts, completions, completion_ids, columns, index) -> RewardError:
        """The error of a function that raised on the batch, naming the first prompt on which it
        raises alone (each row scored by itself to find it; the batch's first where none does)."""
        index = list(index) if index is not None else list(range(len(prompts)))
        for k in range(len(prompts)):
            try:
                fn(prompts=prompts[k:k + 1], completions=completions[k:k + 1], completion_ids=completion_ids[k:k + 1],
                   **{c: v[k:k + 1] for c, v in columns.items()})
            except Exception as alone:  # noqa: BLE001
                return RewardError(f"reward {name_of(fn)} failed on prompt {index[k]} (completion {k} of the round): "
                                   f"{type(alone).__name__}: {alone}")
        return RewardError(f"reward {name_of(fn)} failed on the round's batch (prompts {index[0]}..., none alone): "
                           f"{type(e).__name__}: {e}")
