"""What sampling a completion is, whichever engine samples it: the settings (`Sampling`, TRL's
names), a completion's seed (`draw_seed`), one draw from a row of logits (`draw`) and what comes
back (`Completion`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled, in TRL's names."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_completion_length: int = 256

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature: {self.temperature:g} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p:g} must be in (0, 1]")
        if self.max_completion_length < 1:
            raise ValueError("max_completion_length: at least 1")

    def warpers(self):
        from transformers.generation.logits_process import (
            LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
        )

        out = LogitsProcessorList()
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(self.top_p))
        return out


def draw_seed(seed: int, round_: int, prompt: int, index: int) -> int:
    """The seed of one completion's draws: a function of the run's seed, the generation round,
    the prompt's place in the data and the completion's place in its group, and nothing else."""
    digest = hashlib.sha256(f"rollout/{seed}/{round_}/{prompt}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class Completion:
    """One sampled completion: its token ids (an end-of-sequence id last where it stopped on one),
    the log-probability of each, and whether it reached `max_completion_length` unfinished."""

    ids: list[int]
    logps: list[float]
    truncated: bool
    spans: list | None = None  # [[weight version, tokens], ...] where it spans two (`rollout.partial=continue`)
    restarted: bool = False  # sampled again from its start on newer weights (`rollout.partial=restart`)


def continued_seed(seed: int, tokens: int) -> int:
    """The seed of a completion's draws after its first `tokens`, continued on other weights."""
    digest = hashlib.sha256(f"continued/{seed}/{tokens}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw(logits: torch.Tensor, gens: list[torch.Generator], sampling: Sampling, warp) -> tuple:
    """One token per row of `logits`, each from its own generator after the filters (`warp`), and
    its log-probability under the tempered distribution (before top-k and top-p)."""
    tempered = torch.log_softmax(logits / sampling.temperature, -1)
    seen = torch.zeros((logits.shape[0], 1), dtype=torch.long, device=logits.device)  # the filters read no ids
    probs = torch.softmax(warp(seen, logits.clone()), -1).cpu()
    tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(gens)])
    return tokens, tempered.gather(1, tokens.to(tempered.device)[:, None])[:, 0].cpu()
