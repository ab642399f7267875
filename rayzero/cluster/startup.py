"""A run's start-up, said one line per stage as the stage begins, with the time since the start:

    rayzero: [  0.0s] checking the config, the data and the model
    rayzero: [  2.9s] starting a local Ray
    rayzero: [  6.1s] placing 2 ranks (1 CPU each) and starting their processes
    rayzero: [  9.0s] building and sharding the model on the ranks (initial values, seed 0)
    rayzero: [ 10.2s] compiling the iteration (Ray Compiled Graph)
    rayzero: [ 10.9s] training 100 steps

On stderr, flushed at once: a terminal, `ray job logs` and a notebook's cell show each line as
it comes. Each stage lasts until the next begins; the last, until the first step is done.
Standard library only: the CLI says its first line before it imports torch and Ray.
"""

from __future__ import annotations

import sys
import time

CHECKS = "checking the config, the data and the model"


class Startup:
    def __init__(self, out=None):
        """`out`: where the lines go (None: sys.stderr as it is when a line is written, so
        that a notebook's or pytest's stream gets them)."""
        self.out = out
        self.t0 = time.monotonic()
        self.stages: list[tuple[str, float]] = []  # (key, seconds since the start), as they began
        self.done_s: float | None = None  # when the first step's results came in
        self.parts: dict[str, float] = {}  # seconds of a stage spent on one thing (`part`)
        self._then: list = []  # what waits for the start-up's end (`when_done`)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def stage(self, key: str, text: str) -> None:
        """Stage `key` begins now: say so. After the first step (a restart's rebuild) the line
        is said, but not counted in the start-up's timings."""
        now = self.elapsed()
        if self.done_s is None:
            self.stages.append((key, now))
        print(f"rayzero: [{now:6.1f}s] {text}", file=self.out or sys.stderr, flush=True)

    def say(self, text: str) -> None:
        """A line under the stage now running, indented, that begins no stage: what the checks
        found (the defaults a run takes, what sets its length), timed as the stages' lines are."""
        print(f"rayzero: [{self.elapsed():6.1f}s]   {text}", file=self.out or sys.stderr, flush=True)

    def part(self, key: str, seconds: float) -> None:
        """`seconds` of the start-up went to `key` inside a stage (the first step's compilation):
        in the timings as `key_s`, beside the stages, not added to the total."""
        if self.done_s is None and seconds > 0:
            self.parts[key] = self.parts.get(key, 0.0) + seconds

    def first_step(self) -> None:
        """The first step's results are in: the start-up is over (what waits for it is called)."""
        if self.done_s is None:
            self.done_s = self.elapsed()
            then, self._then = self._then, []
            for fn in then:
                fn()

    def when_done(self, fn) -> None:
        """Call `fn()` once the start-up is over (now, if it is)."""
        if self.done_s is None:
            self._then.append(fn)
        else:
            fn()

    def timings(self) -> dict[str, float]:
        """Seconds per stage, by key + `_s` (a stage said twice, in a restart before the first
        step: summed), each `part` (within a stage: `torch_compile_s`), and `total_s`, from the start
        to the first step's end. Empty before then."""
        if self.done_s is None:
            return {}
        out: dict[str, float] = {}
        ends = [start for _, start in self.stages[1:]] + [self.done_s]
        for (key, start), end in zip(self.stages, ends):
            out[f"{key}_s"] = round(out.get(f"{key}_s", 0.0) + end - start, 3)
        out.update({f"{key}_s": round(v, 3) for key, v in self.parts.items()})  # inside the stages above
        out["total_s"] = round(self.done_s, 3)
        return out
