"""The driver's side of online RL: each generation round's completions, rewards and advantages,
made into the step's rows, and the weights sent to the rollout actors before each round.

    round r      steps [r·mu, (r+1)·mu) train on it (mu = grpo.num_iterations); it is sampled
                 from weight version r·mu (the weights after that many optimizer steps)
    its prompts  P = global_batch_size / num_generations of them: positions [r·P, (r+1)·P) of the
                 prompts in epoch order (a permutation per epoch from (seed, epoch)); with the
                 replay engine, the file's round r, in its order
    its draws    completion i of prompt p: `draw_seed(seed, r, p, i)`, whichever actor samples it
    its rows     prompt by prompt, each prompt's completions by index: row g·p + i

Prompt p of the round goes to actor p mod `rollout.workers`; an actor lost while generating is
replaced (the current weights loaded into it) and its prompts generated again with the same
draws, so the round is what it would have been. The replay engine reads its completions here, on
the driver: a replayed run starts no rollout actor and sends no weights. Rewards run here, on the driver, in the
rollouts' order (TRL's signature, `rewards.py`); a reward that raises ends the run (`RewardError`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from rayzero.objectives.grpo_loss import advantages, nanstd
from rayzero.rollout.engines import ReplayEngine, Sampling, draw_seed
from rayzero.rollout.rewards import RewardError, Rewards

log = logging.getLogger(__name__)


def prompt_order(seed: int, n: int, first: int, count: int) -> list[int]:
    """Positions [first, first + count) of the prompts in epoch order: epoch e is a permutation
    of the n prompts drawn from (seed, e)."""
    out = []
    for pos in range(first, first + count):
        epoch, at = divmod(pos, n)
        out.append(int(_permutation(seed, epoch, n)[at]))
    return out


_perms: dict = {}


def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    key = (seed, epoch, n)
    if key not in _perms:
        _perms.clear()
        _perms[key] = np.random.default_rng([seed, 4, epoch]).permutation(n)
    return _perms[key]


@dataclass
class Round:
    """One generation round: its rows (the step's plan carries them) and what it reports."""

    index: int
    version: int
    rows: list[dict]
    metrics: dict[str, float]
    times: dict[str, float] = field(default_factory=dict)


class Rollouts:
    """The run's prompts, rewards and rollout actors (see the module's doc)."""

    def __init__(self, cfg, prompts: list[dict], prompt_ids: list[list[int]], rewards: Rewards, tokenizer,
                 stop_ids: set[int], factory=None):
        self.cfg, self.g, self.r = cfg, cfg.grpo, cfg.rollout
        self.records, self.ids, self.rewards = prompts, prompt_ids, rewards
        self.tokenizer, self.stop_ids, self.factory = tokenizer, sorted(stop_ids), factory
        self.per_round = cfg.train.global_batch_size // self.g.num_generations
        self.sampling = Sampling(self.g.temperature, self.g.top_p, self.g.top_k, self.g.max_completion_length)
        self.replay = ReplayEngine(self.r.replay) if self.r.engine == "replay" else None
        self.actors: list = []
        self.pg = None
        self.version: int | None = None  # the weights the actors hold
        self.frozen_refs: list = []  # what the first sync sent that never changes (a replacement needs it)
        self.latest_refs: list = []  # the trainable weights of `version`
        self.current: Round | None = None
        self.sync_report: dict[str, float] = {}
        self.replaced = 0

    # -- before the cluster starts -----------------------------------------------------------
    def check(self, steps: int) -> None:
        """Prompts that cannot fit, a replay file that does not match the run: ValueError in one line."""
        room = self.cfg.train.seq_len + 1 - self.g.max_completion_length
        long = [len(i) for i in self.ids if len(i) > room]
        if long:
            raise ValueError(f"{len(long)} of the {len(self.ids)} prompts are longer than train.seq_len + 1 - "
                             f"grpo.max_completion_length = {room} tokens (the longest has {max(long)}); "
                             f"train.seq_len={max(long) + self.g.max_completion_length - 1} would hold them all")
        if self.replay is not None:
            for r in range((steps - 1) // self.g.num_iterations + 1):
                self.replayed(r)

    def replayed(self, r: int) -> list[tuple[int, list[int], list[list[int]]]]:
        """Round r of the replay file: (data index, prompt ids, completions) per prompt, in its order."""
        entries = self.replay.round(r, self.g.num_generations)
        if len(entries) != self.per_round:
            raise ValueError(f"rollout.replay: round {r} of {self.replay.path} has {len(entries)} prompts; a round "
                             f"of train.global_batch_size={self.cfg.train.global_batch_size} / grpo.num_generations="
                             f"{self.g.num_generations} has {self.per_round}")
        index = self._prompt_index()
        out = []
        for e in entries:
            key = _key(e["prompt"])
            if key not in index:
                raise ValueError(f"rollout.replay: round {r}: the prompt {str(e['prompt'])[:60]!r} is not one of "
                                 "the prepared prompts (data.path)")
            p = index[key]
            ids = [int(i) for i in e["prompt_ids"]] if e.get("prompt_ids") is not None else self.ids[p]
            out.append((p, ids, e["completions"]))
        return out

    def _prompt_index(self) -> dict:
        if not hasattr(self, "_index"):
            self._index = {}
            for p, rec in enumerate(self.records):
                self._index.setdefault(_key(rec["prompt"]), p)
        return self._index

    # -- the actors ----------------------------------------------------------------------------
    def start(self) -> None:
        """Reserve the actors' bundles and start them (once: a lost training rank leaves them be)."""
        if self.actors or self.replay is not None:
            return
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": self.r.cpus_per_worker, **({"GPU": self.r.gpus_per_worker} if self.r.gpus_per_worker else {})}
        self.pg = placement_group([dict(bundle) for _ in range(self.r.workers)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=self.cfg.cluster.placement_timeout_s)
        self._strategy = lambda i: PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
        self.actors = [self._actor(i) for i in range(self.r.workers)]

    def _actor(self, i: int):
        from rayzero.workers.rollout import RolloutActor

        return RolloutActor.options(scheduling_strategy=self._strategy(i), num_cpus=self.r.cpus_per_worker,
                                    num_gpus=self.r.gpus_per_worker, max_concurrency=2).remote(
            self.cfg, self.stop_ids, self.factory, i)

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception as e:  # noqa: BLE001 (already gone)
                log.debug("killing a rollout actor: %s", e)
        self.actors = []
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception as e:  # noqa: BLE001
                log.debug("removing the rollout placement group: %s", e)
            self.pg = None

    def sync(self, group, version: int) -> None:
        """The ranks' weights of `version` into every actor, bucket by bucket: everything the
        first time (and after a restart of the ranks), then only what trains."""
        if self.version == version:
            return
        if self.replay is not None:  # nothing samples from the weights
            self.version, self.sync_report = version, {}
            return
        t0 = time.perf_counter()
        first = self.version is None
        sent = group.call("send_weights", version, not first)
        refs = [ref for rank in sent for ref, _ in rank]
        nbytes = sum(n for rank in sent for _, n in rank)
        if first:  # every bucket: what a replacement actor loads, with the trainable ones of later versions
            self.frozen_refs, self.latest_refs = refs, []
        else:
            self.latest_refs = refs
        ray.get([a.load.remote(version, refs) for a in self.actors])
        self.version = version
        self.sync_report = {"sync_ms": (time.perf_counter() - t0) * 1e3, "sync_bytes": float(nbytes)}

    def restarted(self) -> None:
        """The training ranks were placed again: the next sync sends every weight."""
        self.version = None

    # -- a round --------------------------------------------------------------------------------
    def plan(self, step: int, group, checkpoints=None) -> dict:
        """The rollouts of step `step` for its plan ({"step", "rows"}), generating its round at the
        round's first step (the actors given the current weights first). A reward function that
        fails ends the run, after the uploads in flight are committed (`checkpoints`): nothing
        trained is lost."""
        r = step // self.g.num_iterations
        if self.current is None or self.current.index != r:
            self.start()
            self.sync(group, r * self.g.num_iterations)
            try:
                self.current = self.generate(r)
            except RewardError as e:
                e.step = step
                if checkpoints is not None:
                    checkpoints.add_uploads([u for rank in group.call("finish_checkpoints") for u in rank])
                raise
        return {"step": step, "rows": self.current.rows}

    def generate(self, r: int) -> Round:
        g, t0 = self.g, time.perf_counter()
        if self.replay is not None:
            got = self.replayed(r)
            jobs = [{"prompt": p, "ids": ids} for p, ids, _ in got]
            groups = [{"prompt": p, "completions": [{"ids": c, "logps": None, "truncated": None} for c in comps],
                       "version": self.version} for p, _, comps in got]
        else:
            order = prompt_order(self.cfg.train.seed, len(self.ids), r * self.per_round, self.per_round)
            jobs = [{"prompt": p, "ids": self.ids[p],
                     "seeds": [draw_seed(self.cfg.train.seed, r, p, i) for i in range(g.num_generations)]}
                    for p in order]
            groups = self._run(r, jobs)
        t1 = time.perf_counter()
        for done in groups:
            if done["version"] != self.version:
                raise RuntimeError(f"round {r}: completions sampled from weight version {done['version']}, "
                                   f"the run is at version {self.version}")
        rows, metrics = self.score(r, jobs, groups)
        t2 = time.perf_counter()
        times = {"generate_ms": (t1 - t0) * 1e3, "score_ms": (t2 - t1) * 1e3}
        return Round(r, self.version, rows, metrics, times)

    def _run(self, r: int, jobs: list[dict]) -> list[dict]:
        """Every job's group, in the jobs' order; an actor lost on the way replaced and its jobs run again."""
        w = len(self.actors)
        parts = {i: [k for k in range(len(jobs)) if k % w == i] for i in range(w)}
        out: list = [None] * len(jobs)
        pending = {i: self.actors[i].generate.remote(r, [jobs[k] for k in ks], self.sampling)
                   for i, ks in parts.items() if ks}
        while pending:
            i, ref = next(iter(pending.items()))
            try:
                got = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                self.replaced += 1
                if self.replaced > max(3, 3 * w):
                    raise
                log.warning("rollout actor %d was lost generating round %d (%s): replacing it and generating its "
                            "%d prompts again", i, r, type(e).__name__, len(parts[i]))
                self.actors[i] = self._actor(i)
                ray.get(self.actors[i].load.remote(self.version, self.frozen_refs + self.latest_refs))
                pending[i] = self.actors[i].generate.remote(r, [jobs[k] for k in parts[i]], self.sampling)
                continue
            del pending[i]
            for k, done in zip(parts[i], got):
                out[k] = done
        return out

    def score(self, r: int, jobs: list[dict], groups: list[dict]) -> tuple[list[dict], dict[str, float]]:
        """The round's rows and its metrics, TRL's names: rewards per function and weighted,
        advantages in groups, the completions' lengths."""
        g = self.g
        prompts, completions, completion_ids, columns, rows = [], [], [], {}, []
        keys = [k for k in self.records[0] if k != "prompt"] if self.records else []
        conversational = isinstance(self.records[0]["prompt"], list) if self.records else False
        texts = [self.tokenizer.decode(c["ids"]) for d in groups for c in d["completions"]]  # special tokens left out
        n = 0
        for job, done in zip(jobs, groups):
            rec = self.records[job["prompt"]]
            for c in done["completions"]:
                text = texts[n]
                n += 1
                prompts.append(rec["prompt"])
                completions.append([{"role": "assistant", "content": text}] if conversational else text)
                completion_ids.append(list(c["ids"]))
                for k in keys:
                    columns.setdefault(k, []).append(rec[k])
        per_func, total = self.rewards.score(prompts, completions, completion_ids, columns,
                                             [job["prompt"] for job, done in zip(jobs, groups)
                                              for _ in done["completions"]])
        adv, zero_std = advantages(total, g.num_generations, g.scale_rewards, g.advantage_estimator)
        pad = getattr(getattr(self.tokenizer, "tok", None), "pad_token_id", None)
        stops = set(self.stop_ids) | ({pad} if pad is not None else set())  # TRL's eos_and_pad
        truncated = torch.tensor([not ids or ids[-1] not in stops for ids in completion_ids])
        k = 0
        for job, done in zip(jobs, groups):
            for c in done["completions"]:
                rows.append({"ids": list(job["ids"]) + list(c["ids"]), "start": len(job["ids"]),
                             "advantage": float(adv[k]),
                             "masked": bool(g.mask_truncated_completions and truncated[k]) or not c["ids"]})
                k += 1
        lengths = torch.tensor([float(len(ids)) for ids in completion_ids])
        ended = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1)
        metrics = {}
        for i, name in enumerate(self.rewards.names):
            metrics[f"rewards/{name}/mean"] = float(torch.nanmean(per_func[:, i]))
            metrics[f"rewards/{name}/std"] = float(nanstd(per_func[:, i]))
        metrics.update({
            "reward": float(torch.nanmean(total)), "reward_std": float(nanstd(total)),
            "frac_reward_zero_std": float(zero_std.float().mean()),
            "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.float().mean()),
            "completions/mean_terminated_length": float(ended.mean()),
            "completions/min_terminated_length": float(ended.min()),
            "completions/max_terminated_length": float(ended.max()),
        })
        return rows, metrics

    def step_metrics(self, step: int) -> dict[str, float]:
        """What the step reports of the rollouts: the round's metrics at its first step, the weight
        version it was sampled from, and the last sync's time and bytes."""
        cur = self.current
        out = {"weight_version": float(cur.version)} if cur is not None else {}
        if cur is not None and step == cur.index * self.g.num_iterations:
            out.update(cur.metrics)
            out.update(cur.times)
            out.update(self.sync_report)
        return out


def _key(prompt) -> str:
    import json

    return json.dumps(prompt, sort_keys=True)
