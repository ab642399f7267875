"""How the controller runs one iteration's phases on every rank.

All three give the same result; they differ in what one iteration costs the driver:
- `CompiledDispatch`: one Ray Compiled Graph, built once, executed once per iteration;
- `PipelinedDispatch`: every phase submitted at once with `.remote()`, each fed the previous
  phase's ref, then one `ray.get` (the fallback where compiled graphs are unavailable);
- `PerPhaseDispatch`: one `ray.get` per phase (the baseline the benchmark compares against).
"""

from __future__ import annotations

import time
from collections import deque

import ray
from ray.dag import InputNode, MultiOutputNode

# Waiting on a compiled graph's output spins a core in the driver (measured: ~100% of one
# core for the whole iteration). For iterations longer than NAP_MIN_S the driver first
# sleeps NAP_FRACTION of the shortest recent iteration, so on a machine with few cores the
# ranks keep theirs and the spin covers only the remainder.
NAP_MIN_S = 0.005
NAP_FRACTION = 0.97
UNTIMED_ITERATIONS = 1  # the first one compiles and warms up: no guide to the next


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
        self._iterations = 0
        self._recent_s: deque[float] = deque(maxlen=3)  # how long recent iterations' work took

    def run(self, plan: dict) -> list[dict]:
        refs = self.graph.execute(plan)
        expected = min(self._recent_s, default=0.0)
        nap = NAP_FRACTION * expected if expected > NAP_MIN_S else 0.0
        time.sleep(nap)
        t0 = time.perf_counter()
        out = ray.get(refs, timeout=self.timeout_s)
        waited = time.perf_counter() - t0
        self._iterations += 1
        if self._iterations > UNTIMED_ITERATIONS:
            # Waiting at all means the work took nap + wait. No wait means it finished during
            # the nap, some unknown time earlier: assume well earlier, to adapt fast.
            self._recent_s.append(nap + waited if nap == 0 or waited > 1e-3 else 0.8 * nap)
        return out

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
