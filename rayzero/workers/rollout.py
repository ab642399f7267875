"""A rollout actor: the whole policy, for generation only, and the engine that samples from it.

    load(version, buckets)   weights from the training ranks (Ray object refs, one bucket each),
                             loaded bucket by bucket; the first load brings every weight (the
                             model is built on the meta device until then), later ones what
                             changes (with LoRA, the adapters)
    generate(round, jobs)    each job's group of completions ({"prompt": its index in the data,
                             "ids": the prompt's tokens, "seeds": one per completion}), with the
                             weight version they were sampled from

A plain class (`RolloutActor` is it as a Ray actor): the model is built as a rank builds it
before sharding (the model seam, then the LoRA adapters), so a weight's name is the same on both
sides. (The replay engine needs no actor: the driver reads its completions.)
"""

from __future__ import annotations

import os

import ray


class RolloutWorker:
    def __init__(self, cfg, eos_ids: list[int], factory=None, index: int = 0):
        import torch

        from rayzero.rollout.engines import TransformersEngine
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
        self.engine = TransformersEngine(self.model, tuple(eos_ids), self.device)
        self._loaded = False

    def pid(self) -> int:
        return os.getpid()

    def load(self, version: int, buckets: list) -> dict:
        """Weights of `version`, bucket by bucket (each a ref to {name: tensor}); the bytes read."""
        import torch

        nbytes = 0
        for ref in buckets:
            part = ray.get(ref)
            nbytes += sum(t.numel() * t.element_size() for t in part.values())
            unknown = sorted(set(part) - set(self.model.state_dict(keep_vars=True)))
            if unknown:
                raise RuntimeError(f"rollout actor: the weights name {unknown[0]!r}, which its model has not")
            self.model.load_state_dict(part, strict=False, assign=not self._loaded)
            del part
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
        return {"version": version, "bytes": nbytes}

    def generate(self, round_: int, jobs: list[dict], sampling) -> list[dict]:
        """Each job's completions: {"prompt", "completions": [{"ids", "logps", "truncated"}], "version"}."""
        out = []
        for job in jobs:
            if not self._loaded:
                raise RuntimeError("rollout actor: asked to generate before any weights came")
            done = [{"ids": c.ids, "logps": c.logps, "truncated": c.truncated}
                    for c in self.engine.group(job["ids"], job["seeds"], sampling)]
            out.append({"prompt": job["prompt"], "completions": done, "version": self.version})
        return out


RolloutActor = ray.remote(RolloutWorker)
