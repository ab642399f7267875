"""A continuous batch: many groups' completions sampled through `slots` rows of one KV cache, a
finished completion's row given the next completion at once (`rollout.slots`).

    queue     every completion of the groups, in order (group by group, a group's by index)
    row       one completion being sampled: its generator (its seed's), its tokens and their
              log-probabilities; it joins with its prompt's cache (computed once a group) and
              leaves at an end id or `max_completion_length` tokens
    cache     the rows' keys and values, left-padded to the longest row, with a mask of what is
              real; a joining row is written into the cache's last columns (the cache padded on
              the left when its prompt is longer), a leaving one is dropped, and columns no row
              uses any longer are cut from the left

A long completion then holds one row, not a whole group's batch: the short ones' rows go on to
the next prompts. Each row's draws are its own generator's, as in a group's batch; its logits are
computed beside other rows (left padding masked), so they may differ from a group's in the last
bits, which can change a draw at a near tie: the completions depend on the order of the queue,
and so on how a round is spread over the rollout actors, never on timing.

Needs a transformers causal LM whose cache is one full-attention layer per block (transformers'
`DynamicLayer`): a sliding-window cache cannot be padded this way, and is refused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from rayzero.rollout.sampling import Completion, draw


@dataclass
class _Row:
    group: int
    index: int
    gen: torch.Generator
    length: int  # real tokens in the cache (prompt + completion fed so far)
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


class ContinuousBatch:
    """Sampling through `slots` rows; `run(groups, sampling)` -> each group's completions."""

    def __init__(self, engine, slots: int):
        if engine.cache_key is None:
            raise ValueError("rollout.slots: a continuous batch needs a model with a KV cache "
                             "(a transformers causal LM); set rollout.slots=0")
        self.engine, self.slots = engine, slots
        self.forwards = 0  # forward passes of the batch (decode steps)
        self.widths: list[tuple[int, int]] = []  # each forward's (rows, completions still waiting for a row)

    def _forward(self, ids, mask, positions, cache):
        e = self.engine
        out = e.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      **({e.cache_key: cache} if cache is not None else {}))
        return out.logits[:, -1, :].float(), getattr(out, e.cache_key)

    def _prefill(self, prompt_ids: list[int]):
        """The prompt's keys and values per layer ([1, heads, P, dim]) and its last logits."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.engine.device)
        logits, cache = self._forward(ids, None, None, None)  # as a group's batch computes it
        layers = getattr(cache, "layers", None)
        if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
            raise ValueError(f"rollout.slots: a continuous batch needs full-attention cache layers; this model's "
                             f"are {', '.join(kinds)}: set rollout.slots=0")
        return [(layer.keys, layer.values) for layer in layers], logits[0]

    @torch.no_grad()
    def run(self, groups: list[tuple[list[int], list[int]]], sampling) -> list[list]:
        """`groups`: (prompt ids, seeds) each; their completions, a list per group in seed order."""
        from transformers import DynamicCache

        e = self.engine
        warp, limit = sampling.warpers(), sampling.max_completion_length
        queue = deque((g, i, seed) for g, (_, seeds) in enumerate(groups) for i, seed in enumerate(seeds))
        done: list[list] = [[None] * len(seeds) for _, seeds in groups]
        rows: list[_Row] = []
        cache, mask = None, None  # the batch's DynamicCache and [rows, columns] mask (1: a real token)
        prefilled: tuple[int, list, torch.Tensor] | None = None  # (group, its prompt's kv, its last logits)

        def finish(row: _Row) -> bool:
            """Whether `row` is complete (then kept in `done`)."""
            ended = row.ids[-1] in e.eos_set
            if not ended and len(row.ids) < limit:
                return False
            done[row.group][row.index] = Completion(row.ids, row.logps, truncated=not ended)
            return True

        model, was = e.model, e.model.training
        model.eval()
        try:
            while queue or rows:
                while len(rows) < self.slots and queue:  # refill: each free row takes the next completion
                    g, i, seed = queue.popleft()
                    if prefilled is None or prefilled[0] != g:
                        prefilled = (g, *self._prefill(groups[g][0]))
                    _, kv, last = prefilled
                    row = _Row(g, i, torch.Generator(device="cpu").manual_seed(seed), length=kv[0][0].shape[-2])
                    token, logp = draw(last[None], [row.gen], sampling, warp)
                    row.ids.append(int(token[0]))
                    row.logps.append(float(logp[0]))
                    if finish(row):
                        continue
                    cache, mask = _join(cache, mask, kv, DynamicCache)
                    rows.append(row)
                if not rows:
                    continue
                feed = torch.tensor([[r.ids[-1]] for r in rows], dtype=torch.long, device=e.device)
                positions = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=e.device)
                mask = torch.cat([mask, mask.new_ones((len(rows), 1))], 1)
                logits, cache = self._forward(feed, mask, positions, cache)
                self.forwards += 1
                self.widths.append((len(rows), len(queue)))
                tokens, logps = draw(logits, [r.gen for r in rows], sampling, warp)
                keep = []
                for k, row in enumerate(rows):
                    row.length += 1
                    row.ids.append(int(tokens[k]))
                    row.logps.append(float(logps[k]))
                    if not finish(row):
                        keep.append(k)
                if len(keep) < len(rows):
                    rows = [rows[k] for k in keep]
                    if not rows:
                        cache, mask = None, None
                        continue
                    index = torch.tensor(keep, device=e.device)
                    for layer in cache.layers:
                        layer.batch_select_indices(index)
                    mask = mask[index]
                    cache, mask = _trim(cache, mask)
        finally:
            model.train(was)
        return done


def _join(cache, mask, kv: list, cache_class):
    """The batch's cache and mask with one more row, of the prompt's keys and values `kv`,
    right-aligned with the others (the shorter side padded on the left)."""
    p = kv[0][0].shape[-2]
    if cache is None:
        cache = cache_class()
        for n, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), n)
        return cache, torch.ones((1, p), dtype=torch.long, device=kv[0][0].device)
    width = mask.shape[1]
    if p > width:  # the joining prompt is longer than every row: pad them all on the left
        for layer in cache.layers:
            layer.keys = _pad_left(layer.keys, p - width)
            layer.values = _pad_left(layer.values, p - width)
        mask = torch.cat([mask.new_zeros((mask.shape[0], p - width)), mask], 1)
        width = p
    for layer, (k, v) in zip(cache.layers, kv):
        layer.keys = torch.cat([layer.keys, _pad_left(k, width - p)], 0)
        layer.values = torch.cat([layer.values, _pad_left(v, width - p)], 0)
    row = torch.cat([mask.new_zeros((1, width - p)), mask.new_ones((1, p))], 1)
    return cache, torch.cat([mask, row], 0)


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if n == 0 else torch.cat([t.new_zeros((*t.shape[:2], n, t.shape[3])), t], 2)


def _trim(cache, mask):
    """Columns on the left that no row uses any longer, cut."""
    used = mask.any(0).nonzero()
    first = int(used[0]) if len(used) else mask.shape[1]
    if first:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        mask = mask[:, first:]
    return cache, mask
