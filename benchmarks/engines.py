"""Rollout engines of the benchmarks' own, through the engine seam (`rollout.engine=PATH:Class`):

    WaitingEngine  generation that is a wait, not CPU work: what a GPU engine is to the host
                   (`benchmarks/grpo.py --lag`). Each group of completions takes `WAIT_S` of
                   sleep; its tokens are drawn from each completion's own seed, uniform over the
                   vocabulary, `max_completion_length` long.
    HotEngine      the transformers engine sampling at a temperature `HOTTER` times the run's:
                   a sampler that disagrees with the trainer (`benchmarks/grpo.py --mismatch`);
                   the log-probabilities it returns are its own (the hotter distribution's).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from rayzero.rollout.engines import Completion, TransformersEngine

WAIT_S = 0.06  # one group's generation


class WaitingEngine:
    def __init__(self, model, eos_ids, device="cpu"):
        self.vocab = model.get_input_embeddings().num_embeddings
        self.eos = sorted(set(eos_ids))

    def group(self, prompt_ids, seeds, sampling) -> list[Completion]:
        time.sleep(WAIT_S)
        out = []
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            ids = torch.randint(0, self.vocab, (sampling.max_completion_length,), generator=g).tolist()
            ids = [i for i in ids if i not in self.eos] or [0]
            out.append(Completion(ids, [-math.log(self.vocab)] * len(ids), truncated=True))
        return out


HOTTER = 1.6


class HotEngine(TransformersEngine):
    def group(self, prompt_ids, seeds, sampling) -> list[Completion]:
        return super().group(prompt_ids, seeds, replace(sampling, temperature=sampling.temperature * HOTTER))
