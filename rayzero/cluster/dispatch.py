"""How the controller runs one iteration's phases on every rank.

All three give the same result; they differ in what one iteration costs the driver:
- `CompiledDispatch`: one Ray Compiled Graph, built once, executed once per iteration;
- `PipelinedDispatch`: every phase submitted at once with `.remote()`, each fed the previous
  phase's ref, then one `ray.get` (the fallback where compiled graphs are unavailable);
- `PerPhaseDispatch`: one `ray.get` per phase (the baseline the benchmark compares against).
"""

from __future__ import annotations

import ray
from ray.dag import InputNode, MultiOutputNode


def phase_names(num_microbatches: int) -> list[str]:
    return ["gather"] + ["forward", "backward"] * num_microbatches + ["reduce_scatter", "step"]


class CompiledDispatch:
    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        names = phase_names(num_microbatches)
        with InputNode() as plan:
            outputs = []
            for actor in actors:
                node = plan
                for name in names:
                    node = getattr(actor, name).bind(node)
                outputs.append(node)
        self.graph = MultiOutputNode(outputs).experimental_compile()

    def run(self, plan: dict) -> list[dict]:
        return ray.get(self.graph.execute(plan), timeout=self.timeout_s)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.teardown()
            self.graph = None


class PipelinedDispatch:
    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0):
        self.actors, self.names, self.timeout_s = actors, phase_names(num_microbatches), timeout_s

    def run(self, plan: dict) -> list[dict]:
        refs = []
        for actor in self.actors:
            ref = plan
            for name in self.names:
                ref = getattr(actor, name).remote(ref)
            refs.append(ref)
        return ray.get(refs, timeout=self.timeout_s)

    def close(self) -> None:
        pass


class PerPhaseDispatch:
    def __init__(self, actors: list, num_microbatches: int, timeout_s: float = 600.0):
        self.actors, self.names, self.timeout_s = actors, phase_names(num_microbatches), timeout_s

    def run(self, plan: dict) -> list[dict]:
        outs = [plan] * len(self.actors)
        for name in self.names:
            outs = ray.get(
                [getattr(a, name).remote(o) for a, o in zip(self.actors, outs)], timeout=self.timeout_s
            )
        return outs

    def close(self) -> None:
        pass


DISPATCHERS = {"compiled": CompiledDispatch, "pipelined": PipelinedDispatch, "per_phase": PerPhaseDispatch}
