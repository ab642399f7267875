"""A rollout actor: the whole policy, for generation only, and the engine that samples from it.

    load(version, buckets)   weights from the training ranks (Ray object refs, one bucket each),
                             read into a staging buffer beside the model (while a generation may
                             be running: a sync overlaps generation); the first load brings every
                             weight (the model is built on the meta device until then), later
                             ones what changes (with LoRA, the adapters)
    generate(round, jobs,    each job's group of completions ({"prompt": its index in the data,
             sampling,       "ids": the prompt's tokens, "seeds": one per completion}), sampled
             version)        from weight `version`: a staged version is put into the model
                             between generations, never in the middle of one (so a completion
                             is finished on the weights it began with, unless `rollout.partial`
                             hands it on to the next round's); a group at a time, or every job
                             through one continuous batch (`rollout.slots`)
    handed(round)            with `rollout.partial`: the completions round's batch finished for
                             the round before (the rows that round handed on), once they end

A plain class (`RolloutActor` is it as a Ray actor, a few calls at a time: a load and a wait
for handed-on completions beside a generation): the model is built as a rank builds it before
sharding (the model seam, then the LoRA adapters), so a weight's name is the same on both sides. The engine is
`rollout.engine`'s (`rollout/engines.py`). The replay engine needs no actor: the driver reads
its completions.
"""

from __future__ import annotations

import os
import threading
import time

import ray


class RolloutWorker:
    def __init__(self, cfg, eos_ids: list[int], factory=None, index: int = 0):
        import torch

        from rayzero.rollout.engines import make_engine
        from rayzero.workers.assembly import Built, add_adapters, make_spec

        torch.set_num_threads(max(1, int(cfg.rollout.cpus_per_worker)))
        self.cfg, self.index = cfg, index
        self.version = -1
        spec = make_spec(cfg, factory)
        built = Built(spec.build())
        add_adapters(built, cfg, spec)
        self.model = built.model
        self.device = torch.device("cuda", 0) if cfg.rollout.gpus_per_worker and torch.cuda.is_available() else \
            torch.device("cpu")
        self.engine = make_engine(cfg.rollout.engine, self.model, tuple(eos_ids), self.device)
        self._loaded = False
        self._staged: dict[int, list[dict]] = {}  # version -> its buckets, read, not yet in the model
        self._lock = threading.Lock()  # one generation (and one swap of weights) at a time
        self._arrived = threading.Condition()
        self._turns, self._turn = threading.Condition(), 0  # the driver's calls, in its order
        self._handed: dict[tuple, list[dict]] = {}  # (round, turn) -> what its call finished for the round before

    def renew(self, cfg, eos_ids: list[int], factory=None, index: int = 0) -> int:
        """A kept actor (`cluster.keep_ranks`) made anew for the next run, as a new one starts
        (its model built again, no weights, no version): no process start, no imports."""
        self.__init__(cfg, eos_ids, factory, index)
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def load(self, version: int, buckets: list) -> dict:
        """Weights of `version`, bucket by bucket (each a ref to {name: tensor}), read into the
        staging buffer (the first load straight into the model); the bytes read."""
        parts, nbytes = [], 0
        known = set(self.model.state_dict(keep_vars=True))
        for ref in buckets:
            part = ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref
            nbytes += sum(t.numel() * t.element_size() for t in part.values())
            unknown = sorted(set(part) - known)
            if unknown:
                raise RuntimeError(f"rollout actor: the weights name {unknown[0]!r}, which its model has not")
            parts.append(part)
        if not self._loaded:
            with self._lock:
                self._apply(version, parts)
        else:
            with self._arrived:
                self._staged[version] = parts
                self._arrived.notify_all()
        return {"version": version, "bytes": nbytes}

    def _apply(self, version: int, parts: list[dict]) -> None:
        import torch

        for part in parts:
            self.model.load_state_dict(part, strict=False, assign=not self._loaded)
        if not self._loaded:
            left = [n for n, p in self.model.named_parameters() if p.is_meta]
            if left:
                raise RuntimeError(f"rollout actor: no weights came for {left[0]!r} (and {len(left) - 1} more)")
            for name, b in self.model.named_buffers():
                if b.is_meta:
                    raise RuntimeError(f"rollout actor: the buffer {name!r} is still on the meta device")
            self.model.to(self.device, torch.float32)
            self.model.requires_grad_(False)
            self._loaded = True
        self.version = version

    def _use(self, version: int) -> None:
        """The model at weight `version`: a staged one put in (waiting for its load to finish)."""
        if version == self.version:
            return
        with self._arrived:
            if not self._arrived.wait_for(lambda: version in self._staged, timeout=600):
                raise RuntimeError(f"rollout actor: weight version {version} never came (it holds {self.version})")
            parts = self._staged.pop(version)
            for v in [v for v in self._staged if v < version]:  # older versions: never asked for again
                del self._staged[v]
        self._apply(version, parts)

    def generate(self, round_: int, jobs: list[dict], sampling, version: int | None = None, before=None,
                 hand_on: bool = False, turn: int | None = None) -> dict:
        """Each job's completions, sampled from weight `version` (None: the current):
        {"groups": [{"prompt", "completions": [{"ids", "logps", "truncated"}], "version"}], "seconds"}.

        A link of a chain (`rollout.partial`; `hand_on`): the rows `before` (the round before's
        result, or its "handed_on" rows) handed on are finished first, on these weights (their
        completions from `handed(round_)` as soon as they end), and once a row would be left idle
        the completions still sampling are handed on ("handed_on"; None in their groups).
        `turn`: the call's place among the driver's calls to this actor, which run in that order
        (a later one may ask for newer weights than an earlier one)."""
        if turn is not None:
            with self._turns:
                self._turns.wait_for(lambda: self._turn == turn)
        key = (round_, turn)
        try:
            return self._generate(key, jobs, sampling, version, before, hand_on)
        except BaseException as e:
            with self._arrived:  # whoever waits for this call's handed-on completions learns of it
                self._handed.setdefault(key, e)
                self._arrived.notify_all()
            raise
        finally:
            if turn is not None:
                with self._turns:
                    self._turn += 1
                    self._turns.notify_all()

    def _generate(self, key, jobs, sampling, version, before, hand_on) -> dict:
        with self._lock:
            t0 = time.perf_counter()
            if version is not None:
                self._use(version)
            if not self._loaded:
                raise RuntimeError("rollout actor: asked to generate before any weights came")
            slots, handed_on = self.cfg.rollout.slots, []
            groups = [(job["ids"], job["seeds"]) for job in jobs]
            if hand_on:
                rows = before.get("handed_on", []) if isinstance(before, dict) else list(before or [])

                def publish(done):
                    with self._arrived:
                        self._handed[key] = [_completion(c) for c in done]
                        self._arrived.notify_all()

                got, handed_on = self.engine.chain(groups, sampling, slots, rows, self.version,
                                                   self.cfg.rollout.partial, publish)
            elif slots:  # one continuous batch over every job
                got = self.engine.groups(groups, sampling, slots)
            else:
                got = [self.engine.group(job["ids"], job["seeds"], sampling) for job in jobs]
            out = [{"prompt": job["prompt"], "version": self.version,
                    "completions": [None if c is None else _completion(c) for c in done]}
                   for job, done in zip(jobs, got)]
            return {"groups": out, "handed_on": handed_on, "seconds": time.perf_counter() - t0}

    def handed(self, round_: int, turn: int | None = None) -> list[dict]:
        """The completions the call for round `round_` (and `turn`) finished for the round before
        (the rows handed on to it), once the last of them ends."""
        key = (round_, turn)
        with self._arrived:
            if not self._arrived.wait_for(lambda: key in self._handed, timeout=3600):
                raise RuntimeError(f"rollout actor: round {round_} never finished the rows handed on to it")
            got = self._handed.pop(key)
        if isinstance(got, BaseException):
            raise RuntimeError(f"rollout actor: round {round_} failed before it finished the rows handed on to it: "
                               f"{type(got).__name__}: {got}")
        return got


def _completion(c) -> dict:
    out = {"ids": c.ids, "logps": c.logps, "truncated": c.truncated}
    if c.spans is not None:
        out["spans"] = c.spans
    if c.restarted:
        out["restarted"] = True
    return out


RolloutActor = ray.remote(RolloutWorker)
