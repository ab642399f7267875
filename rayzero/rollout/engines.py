"""The rollout seam: an engine turns a prompt into its group of completions, each with the
log-probability of every token it sampled.

    engine         what it does
    transformers   samples with a KV cache through the policy (a transformers causal LM, or any
                   module whose forward takes `past_key_values`), on CPU or one GPU
    replay         reads recorded completions instead (debugging, offline RL, equality tests)
    module:Class   an engine of your own (`rollout.engine=package.module:Class` or
                   `path/to/file.py:Class`): `Class(model, eos_ids, device)` whose
                   `group(prompt_ids, seeds, sampling)` returns one `Completion` per seed (and,
                   for `rollout.slots`, `groups(groups, sampling, slots)` a list per group;
                   for `rollout.partial`, `chain(...)` as `TransformersEngine.chain`)

A completion's random draws are a function of (seed, round, prompt, completion index) only
(`draw_seed`): a group is sampled as one batch of its own (its rows share the prompt, so no
padding), each row from a generator of its own. What a completion is therefore does not depend on
how many engines there are or which one generated it. With `rollout.slots`, an actor's groups go
through one continuous batch instead (`continuous.py`), each row still from its own generator.
Temperature, top-k and top-p are transformers' own logits warpers; generation stops at an
end-of-sequence id or `max_completion_length` tokens. The log-probability returned is of the
tempered distribution before top-k and top-p (what the trainer computes from its logits: TRL's
`logits / temperature`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rayzero._imports import import_path
from rayzero.rollout.continuous import ContinuousBatch
from rayzero.rollout.sampling import Completion, Sampling, draw, draw_seed

__all__ = ["Completion", "ReplayEngine", "Sampling", "TransformersEngine", "draw", "draw_seed", "engine_class",
           "make_engine"]


class TransformersEngine:
    """Batched sampling with a KV cache through `model` (in eval mode, under no_grad)."""

    def __init__(self, model: torch.nn.Module, eos_ids: tuple[int, ...], device: torch.device | str = "cpu"):
        if not eos_ids:
            raise ValueError("an engine needs the tokenizer's end-of-sequence id(s) to know where a completion ends")
        self.model, self.eos, self.device = model, torch.tensor(sorted(set(eos_ids))), torch.device(device)
        self.eos_set = set(int(i) for i in eos_ids)
        import inspect

        params = inspect.signature(model.forward).parameters
        # the KV cache's keyword: `cache` (transformers 5.2x), `past_key_values` (before), or none (recompute)
        self.cache_key = next((k for k in ("cache", "past_key_values") if k in params), None)

    def _step(self, ids, past, whole):
        """The logits after `ids` (one new token per row, with the cache `past`), or after `whole`
        (every token so far) for a model without a cache; and the cache after."""
        if self.cache_key is None:
            return self.model(whole), None
        out = self.model(input_ids=ids, use_cache=True, **({self.cache_key: past} if past is not None else {}))
        return out, getattr(out, self.cache_key, None)

    @torch.no_grad()
    def group(self, prompt_ids: list[int], seeds: list[int], sampling: Sampling) -> list[Completion]:
        """The completions of one prompt, one per seed (`draw_seed`), sampled together."""
        model, n = self.model, len(seeds)
        was = model.training
        model.eval()
        try:
            gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
            warp = sampling.warpers()
            ids = torch.tensor([prompt_ids] * n, dtype=torch.long, device=self.device)
            out, past = self._step(ids, None, ids)
            logits = _logits(out)[:, -1, :].float()
            done = torch.zeros(n, dtype=torch.bool)
            tokens: list[list[int]] = [[] for _ in range(n)]
            logps: list[list[float]] = [[] for _ in range(n)]
            eos = self.eos.to(self.device)
            for t in range(sampling.max_completion_length):
                nxt, logp = draw(logits, gens, sampling, warp)
                for i in range(n):
                    if not done[i]:
                        tokens[i].append(int(nxt[i]))
                        logps[i].append(float(logp[i]))
                done |= torch.isin(nxt, self.eos)
                if bool(done.all()) or t + 1 == sampling.max_completion_length:
                    break
                # a finished row is fed its end id again: its cache grows, nothing of it is kept
                feed = torch.where(done.to(self.device), eos[0], nxt.to(self.device)).unsqueeze(1)
                for i in range(n):
                    if len(tokens[i]) < t + 1:
                        tokens[i].append(int(eos[0]))  # padding for `whole`, dropped below
                whole = torch.cat([ids, torch.tensor(tokens, dtype=torch.long, device=self.device)], 1)
                out, past = self._step(feed, past, whole)
                logits = _logits(out)[:, -1, :].float()
        finally:
            model.train(was)
        result = []
        for i in range(n):
            k = len(logps[i])
            result.append(Completion(tokens[i][:k], logps[i], truncated=not bool(torch.isin(
                torch.tensor(tokens[i][k - 1]), self.eos))))
        return result

    def groups(self, groups: list[tuple[list[int], list[int]]], sampling: Sampling, slots: int = 0) -> list:
        """Several groups' completions ((prompt ids, seeds) each): a group's batch at a time
        (`slots` 0), or one continuous batch of `slots` rows (`rayzero/rollout/continuous.py`)."""
        if not slots:
            return [self.group(prompt, seeds, sampling) for prompt, seeds in groups]
        return ContinuousBatch(self, slots).run(groups, sampling)

    def chain(self, groups: list[tuple[list[int], list[int]]], sampling: Sampling, slots: int, handed: list[dict],
              version: int, partial: str, on_handed_done=None) -> tuple[list, list[dict]]:
        """One link of a rollout actor's chain of rounds (`rollout.partial`): the rows the round
        before handed on (finished here first, given to `on_handed_done`), then `groups` through a
        continuous batch until a row would be left idle; (each group's completions, None where
        handed on; the rows handed on to the next round)."""
        batch = ContinuousBatch(self, slots)
        done = batch.run(groups, sampling, handed, True, version, partial, on_handed_done)
        return done, batch.handed_on


def engine_class(name: str):
    """The engine class `rollout.engine` names (not `replay`, which the driver reads); ValueError in one line."""
    if name == "transformers":
        return TransformersEngine
    cls = import_path(name, "rollout.engine", "package.module:Class or path/to/file.py:Class")
    if not callable(getattr(cls, "group", None)):
        raise ValueError(f"rollout.engine: {name} has no `group(prompt_ids, seeds, sampling)` method: not an engine")
    return cls


def make_engine(name: str, model: torch.nn.Module, eos_ids: tuple[int, ...], device):
    """The engine `rollout.engine` names, over `model` (the rollout actor's whole policy)."""
    return engine_class(name)(model, eos_ids, device)


def _logits(out) -> torch.Tensor:
    return getattr(out, "logits", out)


class ReplayEngine:
    """Recorded completions instead of sampling (`rollout.engine=replay`): JSON lines of
    {"round", "prompt", "prompt_ids" (optional), "index", "completion_ids"}. A round's prompts and
    their order are the file's (in the order of its lines); a round the file lacks is refused."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.rounds: dict[int, dict] = {}
        if not Path(path).is_file():
            raise ValueError(f"rollout.replay: {self.path}: no such file")
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{self.path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            missing = [k for k in ("round", "prompt", "index", "completion_ids") if k not in rec]
            if missing:
                raise ValueError(f"{where}: no {', '.join(map(repr, missing))} (a replay line is {{round, prompt, "
                                 "index, completion_ids}}, prompt_ids optional)")
            prompts = self.rounds.setdefault(int(rec["round"]), {})
            key = json.dumps(rec["prompt"], sort_keys=True)
            entry = prompts.setdefault(key, {"prompt": rec["prompt"], "prompt_ids": rec.get("prompt_ids"),
                                             "completions": {}})
            if int(rec["index"]) in entry["completions"]:
                raise ValueError(f"{where}: completion {rec['index']} of this prompt in round {rec['round']} again")
            entry["completions"][int(rec["index"])] = [int(i) for i in rec["completion_ids"]]
            if rec.get("logprobs") is not None:  # the sampler's, for importance sampling
                if len(rec["logprobs"]) != len(rec["completion_ids"]):
                    raise ValueError(f"{where}: {len(rec['logprobs'])} logprobs for {len(rec['completion_ids'])} "
                                     "completion tokens")
                entry.setdefault("logprobs", {})[int(rec["index"])] = [float(x) for x in rec["logprobs"]]

    def round(self, r: int, num_generations: int) -> list[dict]:
        """Round `r`'s prompts in the file's order: {"prompt", "prompt_ids" (or None),
        "completions": [ids] x num_generations, by index, "logprobs": the sampler's per completion, or None}."""
        if r not in self.rounds:
            have = sorted(self.rounds)
            raise ValueError(f"rollout.replay: {self.path} has no round {r} (it has rounds "
                             f"{have[0]}..{have[-1]})" if have else f"rollout.replay: {self.path} is empty")
        out = []
        for entry in self.rounds[r].values():
            got = sorted(entry["completions"])
            if got != list(range(num_generations)):
                raise ValueError(f"rollout.replay: {self.path}: round {r}, prompt {json.dumps(entry['prompt'])[:60]}: "
                                 f"completions {got}, expected 0..{num_generations - 1} (grpo.num_generations)")
            logprobs = entry.get("logprobs", {})
            out.append({**entry, "completions": [entry["completions"][i] for i in got],
                        "logprobs": [logprobs.get(i) for i in got]})
        return out
