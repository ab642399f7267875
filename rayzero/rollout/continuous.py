"""A continuous batch: many groups' completions sampled through `slots` rows of one KV cache, a
finished completion's row given the next completion at once (`rollout.slots`).

    queue     every completion of the groups, in order (group by group, a group's by index),
              after the rows the batch before handed on (`rollout.partial`)
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

Handed on (`rollout.partial`): once no completion waits for a row, no row handed in is left, and
a row is free, the rows still sampling stop and go to the next round's batch (`ContinuousBatch`);
where that happens is a function of the completions alone.

Needs a transformers causal LM whose cache is one full-attention layer per block (transformers'
`DynamicLayer`): a sliding-window cache cannot be padded this way, and is refused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from rayzero.rollout.sampling import Completion, continued_seed, draw


@dataclass
class _Row:
    group: int  # the group's place in the call; for a row handed in, its place among them
    index: int
    gen: torch.Generator
    length: int  # real tokens in the cache (prompt + completion fed so far)
    seed: int = 0
    prompt: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    spans: list = field(default_factory=list)  # [[version, tokens]] sampled before this batch (a row handed in)
    handed_in: bool = False
    restarted: bool = False


class ContinuousBatch:
    """Sampling through `slots` rows; `run(groups, sampling)` -> each group's completions.

    Handed on (`rollout.partial`, the rounds of one rollout actor as a chain): `run(groups,
    sampling, handed=rows, hand_on=True, version=v)` first takes the rows the batch before handed
    on, each sampled again from its start (`partial="restart"`) or continued from its tokens
    (`"continue"`: its prompt and tokens read into the cache on these weights, its later draws
    from `continued_seed`), then the groups; once none of the groups' completions waits for a row,
    none handed in is left, and a row is free, the rows still sampling stop and are handed on
    (`handed_on`) instead of leaving rows idle (a batch with fewer completions than rows never
    fills, and hands nothing on). The rows handed in always finish here
    (`handed_done`, in their order, given to `on_handed_done` as soon as the last one ends)."""

    def __init__(self, engine, slots: int):
        if engine.cache_key is None:
            raise ValueError("rollout.slots: a continuous batch needs a model with a KV cache "
                             "(a transformers causal LM); set rollout.slots=0")
        self.engine, self.slots = engine, slots
        self.forwards = 0  # forward passes of the batch (decode steps)
        self.widths: list[tuple[int, int]] = []  # each forward's (rows, completions still waiting for a row)
        self.handed_done: list[Completion] = []
        self.handed_on: list[dict] = []

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
    def run(self, groups: list[tuple[list[int], list[int]]], sampling, handed: list[dict] = (),
            hand_on: bool = False, version: int = 0, partial: str = "continue", on_handed_done=None) -> list[list]:
        """`groups`: (prompt ids, seeds) each; their completions, a list per group in seed order
        (None for one handed on). `handed`: rows the batch before handed on ({"prompt_ids", "seed",
        "ids", "logps", "spans"}), finished here first."""
        from transformers import DynamicCache

        e = self.engine
        warp, limit = sampling.warpers(), sampling.max_completion_length
        queue = deque([("handed", k, 0) for k in range(len(handed))]
                      + [(g, i, seed) for g, (_, seeds) in enumerate(groups) for i, seed in enumerate(seeds)])
        done: list[list] = [[None] * len(seeds) for _, seeds in groups]
        self.handed_done, self.handed_on = [None] * len(handed), []
        left = len(handed)  # rows handed in, not yet finished
        fills = hand_on and len(queue) >= self.slots  # a batch that fills its rows hands on (one that never does, not)
        if not left and on_handed_done is not None:
            on_handed_done([])
        rows: list[_Row] = []
        cache, mask = None, None  # the batch's DynamicCache and [rows, columns] mask (1: a real token)
        prefilled: tuple[int, list, torch.Tensor] | None = None  # (group, its prompt's kv, its last logits)

        def spans(row: _Row) -> list:
            """The versions of the row's tokens, [[version, tokens], ...]."""
            out = [list(s) for s in row.spans]
            now = len(row.ids) - sum(n for _, n in out)
            if now:
                if out and out[-1][0] == version:
                    out[-1][1] += now
                else:
                    out.append([version, now])
            return out

        def finish(row: _Row) -> bool:
            """Whether `row` is complete (then kept in `done`, or `handed_done`)."""
            nonlocal left
            ended = row.ids[-1] in e.eos_set
            if not ended and len(row.ids) < limit:
                return False
            c = Completion(row.ids, row.logps, truncated=not ended, restarted=row.restarted)
            if row.handed_in:
                c.spans = spans(row)
                self.handed_done[row.group] = c
                left -= 1
                if not left and on_handed_done is not None:
                    on_handed_done(self.handed_done)
            else:
                done[row.group][row.index] = c
            return True

        def admit(item) -> _Row:
            """A row for the next completion waiting, its cache (prompt, and tokens handed in) to join."""
            nonlocal prefilled
            g, i, seed = item
            if g == "handed":
                h = handed[i]
                prompt = [int(t) for t in h["prompt_ids"]]
                if partial == "restart" or not h["ids"]:  # from its start, on these weights
                    kv, last = self._prefill(prompt)
                    row = _Row(i, 0, torch.Generator(device="cpu").manual_seed(int(h["seed"])), kv[0][0].shape[-2],
                               int(h["seed"]), prompt, handed_in=True, restarted=True)
                    return row, kv, last
                ids = [int(t) for t in h["ids"]]
                kv, _ = self._prefill(prompt + ids[:-1])  # the last token is fed as the next input
                gen = torch.Generator(device="cpu").manual_seed(continued_seed(int(h["seed"]), len(ids)))
                row = _Row(i, 0, gen, kv[0][0].shape[-2], int(h["seed"]), prompt, ids, [float(x) for x in h["logps"]],
                           [list(s) for s in h["spans"]], handed_in=True)
                return row, kv, None
            if prefilled is None or prefilled[0] != g:
                prefilled = (g, *self._prefill(groups[g][0]))
            _, kv, last = prefilled
            return _Row(g, i, torch.Generator(device="cpu").manual_seed(seed), kv[0][0].shape[-2], seed,
                        groups[g][0]), kv, last

        model, was = e.model, e.model.training
        model.eval()
        try:
            while queue or rows:
                while len(rows) < self.slots and queue:  # refill: each free row takes the next completion
                    row, kv, last = admit(queue.popleft())
                    if last is not None:  # its first token, from the prompt's last logits
                        token, logp = draw(last[None], [row.gen], sampling, warp)
                        row.ids.append(int(token[0]))
                        row.logps.append(float(logp[0]))
                        if finish(row):
                            continue
                    cache, mask = _join(cache, mask, kv, DynamicCache)
                    rows.append(row)
                if not rows:
                    continue
                if fills and not queue and not left and len(rows) < self.slots:  # a row idle, nothing waits for it
                    self.handed_on = [{"group": r.group, "index": r.index, "prompt_ids": r.prompt, "seed": r.seed,
                                       "ids": r.ids, "logps": r.logps, "spans": spans(r)} for r in rows]
                    break
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
