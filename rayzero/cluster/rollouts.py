"""The driver's side of online RL: each generation round's completions, rewards and advantages,
made into the step's rows, and the weights sent to the rollout actors.

    round r      steps [r·mu, (r+1)·mu) train on it (mu = grpo.num_iterations); it is sampled
                 from weight version max(0, r - k)·mu (k = rollout.max_lag; the weights after that
                 many optimizer steps): at k = 0 the weights just trained, at k > 0 the rollout
                 actors generate rounds r+1 … r+k while the ranks train round r
    its prompts  P = global_batch_size / num_generations of them: positions [r·P, (r+1)·P) of the
                 prompts in epoch order (a permutation per epoch from (seed, epoch)); with the
                 replay engine, the file's round r, in its order
    its draws    completion i of prompt p: `draw_seed(seed, r, p, i)`, whichever actor samples it

At a round's first step the driver sends the actors the weights of that step (`sync`: the actors
stage them beside the model and put them in between generations), starts round r + k (a
"flight"), and waits for round r, started k rounds before: what a step waits for is
max(generate, train) + sync rather than their sum. Which weights a round is sampled from is a
function of its index alone, never of timing, so a run at any lag is deterministic, and at k = 0
it is the synchronous run. An actor runs the driver's calls to it in the order they were made.

With `rollout.partial` (restart or continue) each actor's rounds are a chain: its call for round
r + 1 first finishes the completions its call for round r handed on (on round r + 1's weights),
then samples its own, and hands on those still sampling once a row of its batch would be left
idle. Round r is then complete once the next round's calls have finished what it handed on
(`handed`), always before that round is waited for; the rows handed on travel from one call to
the next as its result (or, after a checkpoint, as the manifest kept them). Where a call hands
on is a function of the completions alone, never of timing.

Prompt p of a round goes to actor p mod `rollout.workers`; an actor lost while generating is
replaced (given every weight version its rounds in flight need) and its prompts generated again
with the same draws, so each round is what it would have been. At a checkpoint the rounds in
flight are waited for and kept in the manifest (`state`), so that a resume continues bitwise at
any lag (`restore`). The replay engine reads its completions here, on the driver: a replayed run
starts no rollout actor and sends no weights. Rewards run here, on the driver, in the rollouts'
order (TRL's signature, `rewards.py`); a reward that raises ends the run (`RewardError`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from rayzero.cluster.rollout_actors import RolloutActors
from rayzero.objectives.grpo_loss import advantages, nanstd
from rayzero.rollout.engines import ReplayEngine, Sampling, draw_seed
from rayzero.rollout.rewards import RewardError, Rewards

log = logging.getLogger(__name__)


def prompt_order(seed: int, n: int, first: int, count: int, stream: int = 0) -> list[int]:
    """Positions [first, first + count) of the prompts in epoch order: epoch e is a permutation
    of the n prompts drawn from (seed, e). `stream` 1: the order dynamic sampling draws its
    extra prompts in, a permutation of its own."""
    out = []
    for pos in range(first, first + count):
        epoch, at = divmod(pos, n)
        out.append(int(_permutation(seed, epoch, n, stream)[at]))
    return out


_perms: dict = {}


def _permutation(seed: int, epoch: int, n: int, stream: int = 0) -> np.ndarray:
    key = (seed, epoch, n, stream)
    if key not in _perms:
        if len(_perms) > 8:
            _perms.clear()
        _perms[key] = np.random.default_rng([seed, 4 + stream, epoch]).permutation(n)
    return _perms[key]


@dataclass
class Round:
    """One generation round: its rows (the step's plan carries them) and what it reports."""

    index: int
    version: int
    rows: list[dict]
    metrics: dict[str, float]
    times: dict[str, float] = field(default_factory=dict)


@dataclass
class Flight:
    """A round on its way: its jobs, the weight version it is sampled from, and each actor's
    part (job indices, the call's ref and, once fetched, its result); `groups` once collected (or
    restored from a checkpoint). A link of the actors' chains (`chained`, rollout.partial): each
    actor's call also finishes the completions the round before handed on to it (`handed_refs`,
    then `handed`), and may hand some of its own on to the next round's call."""

    index: int
    version: int
    jobs: list[dict]
    parts: dict[int, list[int]] = field(default_factory=dict)
    refs: dict = field(default_factory=dict)
    groups: list | None = None
    seconds: float = 0.0  # the slowest actor's time generating its part
    chained: bool = False
    results: dict = field(default_factory=dict)  # actor -> its call's result, fetched
    handed_refs: dict = field(default_factory=dict)  # actor -> the round before's completions its call finishes
    handed: dict = field(default_factory=dict)  # actor -> those completions, fetched
    turns: dict = field(default_factory=dict)  # actor -> the call's place among the driver's calls to it


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
        self.lag = self.r.max_lag
        self.pool = RolloutActors(cfg, self.stop_ids, factory)
        self.version: int | None = None  # the latest weights sent to the actors
        self.frozen_refs: list = []  # what the first sync sent (every weight): what a replacement loads first
        self.refs_of: dict[int, list] = {}  # version -> its trainable weights (a replacement's later loads)
        self.flights: dict[int, Flight] = {}  # round -> on its way (or waited for), not yet trained
        self.extras: list[Flight] = []  # dynamic sampling's extra prompts, being generated
        self.chained = self.r.partial != "finish" and self.replay is None
        self.previous: Flight | None = None  # the round trained last (what the next one's calls carry on from)
        self.turn: dict[int, int] = {}  # actor -> the place of the next call to it
        self.extra_pos = 0  # how many extra prompts dynamic sampling has drawn
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
                got = self.replayed(r)
                if self.r.is_correction != "none" and any(lp is None for *_, logps in got for lp in logps):
                    raise ValueError(f"rollout.is_correction={self.r.is_correction}: round {r} of {self.replay.path} "
                                     "has completions without the sampler's `logprobs`; record them, or set "
                                     "rollout.is_correction=none")

    def replayed(self, r: int) -> list[tuple[int, list[int], list[list[int]], list]]:
        """Round r of the replay file: (data index, prompt ids, completions, their sampler log-probs
        or None each) per prompt, in its order."""
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
            out.append((p, ids, e["completions"], e["logprobs"]))
        return out

    def _prompt_index(self) -> dict:
        if not hasattr(self, "_index"):
            self._index = {}
            for p, rec in enumerate(self.records):
                self._index.setdefault(_key(rec["prompt"]), p)
        return self._index

    # -- the actors ----------------------------------------------------------------------------
    def start(self) -> None:
        """The actors started (`rollout_actors.py`) as soon as the ranks are placed, so that their
        processes start while the ranks build the model; once: a lost training rank leaves them be."""
        if self.replay is None:
            self.pool.start()

    @property
    def actors(self) -> list:
        return self.pool.actors

    def close(self, keep: bool = False) -> None:
        """The actors killed, or kept for the next run (`keep`: the run ended well) once idle."""
        self.pool.close(keep, idle=self._idle)

    def _idle(self, timeout_s: float = 10.0) -> bool:
        """Whether every call made to the actors has returned (the rounds a lag started past the
        last step: waited for up to `timeout_s`)."""
        flights = [*self.flights.values(), *self.extras, *([self.previous] if self.previous is not None else [])]
        refs = [ref for f in flights for ref in (*f.refs.values(), *f.handed_refs.values())]
        if not refs:
            return True
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        return len(done) == len(refs)

    def sync(self, group, version: int) -> None:
        """The ranks' weights of `version` into every actor, bucket by bucket: everything the
        first time (and after a restart of the ranks), then only what trains. The actors stage
        them (a generation in flight goes on) and put them in before the round that asks for them."""
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
            self.frozen_refs, self.refs_of = refs, {version: []}
        else:
            self.refs_of[version] = refs
        loads = [a.load.remote(version, refs) for a in self.actors]
        for i, ref in enumerate(loads):
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                self._lost(i, f"taking weight version {version}", e)
                self._replace(i, also=version)
        self.version = version
        self.sync_report = {"sync_ms": (time.perf_counter() - t0) * 1e3, "sync_bytes": float(nbytes)}

    def restarted(self) -> None:
        """The training ranks were placed again: the next sync sends every weight."""
        self.version = None

    # -- a round --------------------------------------------------------------------------------
    def version_of(self, r: int) -> int:
        """The weight version round r is sampled from: k rounds back (k = rollout.max_lag), never before 0."""
        return max(0, r - self.lag) * self.g.num_iterations

    def plan(self, step: int, group, checkpoints=None) -> dict:
        """The rollouts of step `step` for its plan ({"step", "rows"}). At a round's first step:
        the actors given the weights of this step, round r + max_lag started, round r waited for
        and scored. A reward function that fails ends the run, after the uploads in flight are
        committed (`checkpoints`): nothing trained is lost."""
        mu = self.g.num_iterations
        r = step // mu
        if self.current is None or self.current.index != r:
            self.start()
            self.sync(group, r * mu)
            for q in range(r, r + self.lag + 1):  # each from the weights just sent, or ones sent before
                if q not in self.flights:
                    self.flights[q] = self.launch(q)
            try:
                self.current = self.generate(r)
            except RewardError as e:
                e.step = step
                if checkpoints is not None:
                    checkpoints.add_uploads([u for rank in group.call("finish_checkpoints") for u in rank])
                raise
            self.previous = self.flights.pop(r, None)
            needed = {f.version for f in self.flights.values()} | {self.version}
            self.refs_of = {v: refs for v, refs in self.refs_of.items() if v in needed}
        return {"step": step, "rows": self.current.rows}

    def launch(self, r: int) -> Flight:
        """Round r started on the actors (from weight version `version_of(r)`), or read from the replay file."""
        v = self.version_of(r)
        if self.replay is not None:
            got = self.replayed(r)
            flight = Flight(r, v, [{"prompt": p, "ids": ids} for p, ids, _, _ in got])
            flight.groups = [{"prompt": p, "completions": [{"ids": c, "logps": lp, "truncated": None}
                                                          for c, lp in zip(comps, logps)], "version": v}
                             for p, _, comps, logps in got]
            return flight
        g = self.g
        order = prompt_order(self.cfg.train.seed, len(self.ids), r * self.per_round, self.per_round)
        jobs = [{"prompt": p, "ids": self.ids[p],
                 "seeds": [draw_seed(self.cfg.train.seed, r, p, i) for i in range(g.num_generations)]}
                for p in order]
        return self._start(Flight(r, v, jobs, chained=self.chained))

    def _start(self, flight: Flight) -> Flight:
        """`flight` on the actors: job k to actor k mod `rollout.workers`."""
        w = len(self.actors)
        flight.parts = {i: ks for i in range(w) if (ks := list(range(i, len(flight.jobs), w)))}
        for i in flight.parts:
            flight.refs[i] = self._submit(i, flight)
        return flight

    def _submit(self, i: int, flight: Flight):
        """Actor i's call for its part of `flight`, after every call made to it before (`turn`). A
        link of the chain carries on from the round before's: the completions that one handed on
        (its result, resolved by Ray, or as fetched) are finished first, and `handed` waits for them."""
        jobs = [flight.jobs[k] for k in flight.parts[i]]
        turn = flight.turns[i] = self.turn.get(i, 0)
        self.turn[i] = turn + 1
        flight.results.pop(i, None)
        if not flight.chained:
            return self.actors[i].generate.remote(flight.index, jobs, self.sampling, flight.version, turn=turn)
        flight.handed.pop(i, None)
        flight.handed_refs[i] = self.actors[i].handed.remote(flight.index, turn)
        return self.actors[i].generate.remote(flight.index, jobs, self.sampling, flight.version,
                                              self._before(i, flight.index), True, turn)

    def _flight(self, r: int) -> Flight | None:
        if r in self.flights:
            return self.flights[r]
        return self.previous if self.previous is not None and self.previous.index == r else None

    def _before(self, i: int, r: int):
        """What actor i's link of round r carries on from: round r - 1's call on it (its result,
        or the call's ref), or nothing."""
        prev = self._flight(r - 1)
        if prev is None or not prev.chained or i not in prev.parts:
            return []
        return prev.results[i]["handed_on"] if i in prev.results else prev.refs[i]

    def generate(self, r: int) -> Round:
        """Round r waited for (started by `launch`, or restored), its completions checked to be of
        the version it was asked for, and scored."""
        t0 = time.perf_counter()
        flight = self.flights.get(r) or self.launch(r)
        self.flights[r] = flight
        groups = self.collect(flight)
        t1 = time.perf_counter()
        for done in groups:
            if done["version"] != flight.version:
                raise RuntimeError(f"round {r}: completions sampled from weight version {done['version']}, "
                                   f"it was asked for version {flight.version}")
        if self.r.is_correction != "none" and any(c.get("logps") is None for d in groups for c in d["completions"]):
            raise RuntimeError(f"rollout.is_correction={self.r.is_correction}: the engine {self.r.engine} returned "
                               "completions without their log-probabilities, which the correction weighs by")
        jobs, rewards, extra = flight.jobs, self.rewards_of(flight.jobs, groups), {}
        if flight.chained:
            extra = _handed_metrics(groups, flight.version)
        if self.r.dynamic_sampling:
            jobs, groups, rewards, filled = self.fill(flight, groups, rewards)
            extra.update(filled)
        rows, metrics = self.score(r, jobs, groups, rewards)
        t2 = time.perf_counter()
        times = {"generate_ms": flight.seconds * 1e3, "wait_ms": (t1 - t0) * 1e3, "score_ms": (t2 - t1) * 1e3}
        return Round(r, flight.version, rows, {**metrics, **extra}, times)

    def fill(self, flight: Flight, groups: list[dict], rewards) -> tuple:
        """DAPO's dynamic sampling: a group whose rewards are all equal (no advantage, no gradient)
        replaced by the group of the next extra prompt (in an order of their own, sampled from the
        weights sent last: the round's own at max_lag 0), until the round is full or
        `rollout.max_extra_prompts` were drawn; a round still short trains on the groups it has,
        in fewer micro-batches (the ranks pad them to whole ones: `data/rollouts.py`), or on one
        all-equal group if it has none. (jobs, groups, rewards, metrics) of the round kept."""
        g, n = self.g.num_generations, self.per_round
        kept, equal, drawn = [], [], 0
        batch = [(flight.jobs, groups, rewards)]
        while batch:
            jobs_, groups_, (per_func, total) = batch.pop()
            for k, (job, done) in enumerate(zip(jobs_, groups_)):
                part = (job, done, per_func[k * g:(k + 1) * g], total[k * g:(k + 1) * g])
                (equal if bool(torch.isclose(nanstd(part[3]), torch.zeros(()))) or bool(part[3].isnan().all())
                 else kept).append(part)
            need = n - len(kept)
            more = min(need, self.r.max_extra_prompts - drawn)
            if need > 0 and more > 0:
                order = prompt_order(self.cfg.train.seed, len(self.ids), self.extra_pos, more, stream=1)
                self.extra_pos, drawn = self.extra_pos + more, drawn + more
                jobs = [{"prompt": p, "ids": self.ids[p], "seeds": [draw_seed(self.cfg.train.seed, -(flight.index + 1),
                                                                              p, i) for i in range(g)]}
                        for p in order]
                # from the weights sent last (the round's own at max_lag 0): an actor's calls run in
                # the driver's order, and the rounds started since the round's own ask for newer ones
                extra = self._start(Flight(flight.index, self.version, jobs))
                self.extras = [extra]
                got = self.collect(extra)
                self.extras = []
                flight.seconds += extra.seconds
                batch.append((jobs, got, self.rewards_of(jobs, got)))
        # a round still short trains on the groups it has (fewer micro-batches); with none, on one all-equal group
        chosen = kept[:n] or equal[:1]
        short = len(chosen) - len(kept[:n])
        metrics = {"dynamic_sampling/extra_prompts": float(drawn), "dynamic_sampling/equal_kept": float(short),
                   "dynamic_sampling/equal_dropped": float(len(equal) - short),
                   "dynamic_sampling/groups": float(len(chosen))}
        return ([c[0] for c in chosen], [c[1] for c in chosen],
                (torch.cat([c[2] for c in chosen]), torch.cat([c[3] for c in chosen])), metrics)

    def collect(self, flight: Flight) -> list[dict]:
        """Every job's group of `flight`, in the jobs' order (a link's completions handed on taken
        from the next round's calls); an actor lost on the way replaced and its parts of every
        round in flight started again (with the same draws, from the same weights)."""
        if flight.groups is not None:
            return flight.groups
        out: list = [None] * len(flight.jobs)
        for i in flight.parts:
            got = self._fetch(flight, i, "results")
            flight.seconds = max(flight.seconds, got["seconds"])
            groups = [{**g, "completions": list(g["completions"])} for g in got["groups"]]
            if got.get("handed_on"):
                after = self._flight(flight.index + 1)
                if after is None or i not in after.parts:
                    raise RuntimeError(f"round {flight.index}: completions handed on to round {flight.index + 1}, "
                                       "which was not started")
                for h, c in zip(got["handed_on"], self._fetch(after, i, "handed")):
                    groups[h["group"]]["completions"][h["index"]] = c
            for k, done in zip(flight.parts[i], groups):
                out[k] = done
        flight.groups = out
        return out

    def _fetch(self, flight: Flight, i: int, what: str):
        """Actor i's call of `flight` (`results`), or the completions it finished for the round
        before (`handed`), waited for; the actor replaced if it was lost."""
        store, refs = (flight.results, flight.refs) if what == "results" else (flight.handed, flight.handed_refs)
        while i not in store:
            try:
                store[i] = ray.get(refs[i])
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                self._lost(i, f"generating round {flight.index}", e,
                           f" and generating its {len(flight.parts[i])} prompts again")
                self._replace(i)
        return store[i]

    def _lost(self, i: int, doing: str, e: Exception, then: str = "") -> None:
        self.replaced += 1
        if self.replaced > max(3, 3 * len(self.actors)):
            raise e
        log.warning("rollout actor %d was lost %s (%s): replacing it%s", i, doing, type(e).__name__, then)

    def _pending(self, f: Flight, i: int) -> bool:
        """Whether actor i's part of `f` is still needed from it: its result, or (a link) the
        completions it finishes for a round not yet collected."""
        if i not in f.parts:
            return False
        if i not in f.results and f.groups is None:
            return True
        before = self._flight(f.index - 1)
        return f.chained and i not in f.handed and before is not None and before.groups is None

    def _replace(self, i: int, also: int | None = None) -> None:
        """A new actor i, given every weight version its calls still needed ask for (and `also`),
        and those calls again, in their order."""
        self.actors[i] = self.pool.actor(i)
        self.turn[i] = 0
        every = [f for f in [self.previous, *self.flights.values(), *self.extras] if f is not None]
        calls = sorted((f for f in every if self._pending(f, i)), key=lambda f: f.turns.get(i, 0))
        versions = sorted({f.version for f in calls} | ({also} if also is not None else set()))
        for n, v in enumerate(versions):
            ray.get(self.actors[i].load.remote(v, (self.frozen_refs if n == 0 else []) + self.refs_of.get(v, [])))
        for f in calls:
            f.refs[i] = self._submit(i, f)

    # -- a checkpoint ---------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint keeps of the rollouts: the rounds started and not yet trained, waited
        for (with a lag, their weights are no longer anywhere else), their completions and versions
        (a link's: each actor's call as it returned, the rows it handed on among them, and the
        completions it finished for the round before)."""
        rounds = {}
        for q in sorted(self.flights):
            f = self.flights[q]
            if self.current is not None and q <= self.current.index:
                continue
            if f.chained:
                for i in f.parts:
                    self._fetch(f, i, "results")
                    self._fetch(f, i, "handed")
                rounds[str(q)] = {"version": f.version, "jobs": f.jobs,
                                  "parts": {str(i): ks for i, ks in f.parts.items()},
                                  "results": {str(i): got for i, got in f.results.items()},
                                  "handed": {str(i): got for i, got in f.handed.items()}}
                continue
            rounds[str(q)] = {"version": f.version, "jobs": f.jobs, "groups": self.collect(f),
                              "seconds": f.seconds}
        return {"rounds": rounds, "extra_prompts": self.extra_pos, "partial": self.r.partial,
                "workers": len(self.actors) or self.r.workers}

    def restore(self, state: dict | None) -> None:
        """Continue from a checkpoint's `state` (None: from the start): its rounds in flight, as they were."""
        self.flights, self.current, self.extras, self.previous = {}, None, [], None
        self.extra_pos = int((state or {}).get("extra_prompts", 0))
        was = (state or {}).get("partial", "finish")
        if (state or {}).get("rounds") and (was == "finish") != (self.r.partial == "finish"):
            raise ValueError(f"rollout.partial: the checkpoint's rounds in flight were sampled with "
                             f"rollout.partial={was}; resume with it (this run has {self.r.partial})")
        chained = [q for q, f in ((state or {}).get("rounds") or {}).items() if "results" in f]
        had = (state or {}).get("workers")
        if chained and had is not None and int(had) != self.r.workers:
            raise ValueError(f"rollout.workers: the checkpoint's rounds in flight ({', '.join(chained)}) hand "
                             f"completions on from one rollout actor to its next call, over {had} actors; resume "
                             f"with rollout.workers={had} (this run has {self.r.workers})")
        for q, f in ((state or {}).get("rounds") or {}).items():
            flight = Flight(int(q), int(f["version"]), f["jobs"])
            if "results" in f:  # a link of the chains
                flight.chained = True
                flight.parts = {int(i): ks for i, ks in f["parts"].items()}
                flight.results = {int(i): got for i, got in f["results"].items()}
                flight.handed = {int(i): got for i, got in f["handed"].items()}
            else:
                flight.groups, flight.seconds = f["groups"], float(f.get("seconds", 0.0))
            self.flights[int(q)] = flight

    def rewards_of(self, jobs: list[dict], groups: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each function's rewards [N, F], the weighted sum [N]) of the groups' completions (TRL's signature)."""
        prompts, completions, completion_ids, columns = [], [], [], {}
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
        return self.rewards.score(prompts, completions, completion_ids, columns,
                                  [job["prompt"] for job, done in zip(jobs, groups) for _ in done["completions"]])

    def score(self, r: int, jobs: list[dict], groups: list[dict], rewards=None) -> tuple[list[dict], dict[str, float]]:
        """The round's rows and its metrics, TRL's names: rewards per function and weighted
        (`rewards`: already computed), advantages in groups, the completions' lengths."""
        g = self.g
        rows = []
        completion_ids = [list(c["ids"]) for d in groups for c in d["completions"]]
        per_func, total = rewards if rewards is not None else self.rewards_of(jobs, groups)
        adv, zero_std = advantages(total, g.num_generations, g.scale_rewards, g.advantage_estimator)
        pad = getattr(getattr(self.tokenizer, "tok", None), "pad_token_id", None)
        stops = set(self.stop_ids) | ({pad} if pad is not None else set())  # TRL's eos_and_pad
        truncated = torch.tensor([not ids or ids[-1] not in stops for ids in completion_ids])
        k = 0
        for job, done in zip(jobs, groups):
            for c in done["completions"]:
                rows.append({"ids": list(job["ids"]) + list(c["ids"]), "start": len(job["ids"]),
                             "advantage": float(adv[k]), "logps": c.get("logps"),
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
        # staleness: optimizer steps between the weights the completions came from and the ones they train
        out = {"weight_version": float(cur.version), "staleness": float(step - cur.version)} if cur is not None else {}
        if cur is not None and step == cur.index * self.g.num_iterations:
            out.update(cur.metrics)
            out.update(cur.times)
            out.update(self.sync_report)
        return out


def _handed_metrics(groups: list[dict], version: int) -> dict[str, float]:
    """How much of a round its actors' next calls finished (`rollout.partial`): the share of its
    completions handed on, and of its tokens sampled from newer weights than the round's."""
    completions = [c for d in groups for c in d["completions"]]
    tokens = sum(len(c["ids"]) for c in completions) or 1
    newer = sum(n for c in completions for v, n in c.get("spans") or () if v > version)
    handed = sum(1 for c in completions if "spans" in c)
    return {"partial/handed_on": handed / max(1, len(completions)), "partial/newer_tokens": newer / tokens}


def _key(prompt) -> str:
    import json

    return json.dumps(prompt, sort_keys=True)
