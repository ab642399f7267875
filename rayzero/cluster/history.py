"""What the controller keeps of a run as it goes: each step's loss, times and metrics, and the
ranks' memory ledgers; the summary and `Result.history` are made from it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rayzero.sharding.memory import bytes_per_param
from rayzero.workers.phases import ITERATION

PHASES = ITERATION  # the phases each step times
WARMUP_STEPS = 1  # the first iteration compiles the graph and faults in memory: not timed


@dataclass
class History:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    phase_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    skipped: int = 0
    memory: list[dict[str, int]] = field(default_factory=list)  # each rank's ledger, latest
    rows: list[dict] = field(default_factory=list)  # each step's metrics, as logged to MLflow
    val_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)

    def record(self, step: int, loss: float, step_s: float, phase_s: dict[str, float]) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.step_s.append(step_s)
        for p in PHASES:
            self.phase_s[p].append(phase_s[p])

    def rewind(self, step: int) -> list[dict]:
        """Forget iterations from `step` on: a resumed group runs them again (from step 0,
        the evaluation before it too). Returns the rows forgotten."""
        keep = sum(1 for s in self.steps if s < step)
        for values in (self.steps, self.losses, self.step_s, *self.phase_s.values()):
            del values[keep:]
        first = step if step > 0 else -1  # the evaluation before step 0 is logged at step -1
        dropped = [r for r in self.rows if r["step"] >= first]
        self.rows[:] = [r for r in self.rows if r["step"] < first]
        keep = sum(1 for s in self.val_steps if s < step) if step > 0 else 0
        del self.val_steps[keep:], self.val_losses[keep:]
        return dropped

    def timed(self, values: list[float]) -> list[float]:
        return values[WARMUP_STEPS:] or values


def memory_metrics(reports: list[dict[str, int]], num_params: int) -> dict[str, float]:
    """The ledger as MLflow metrics: bytes per parameter per category (max over ranks), the
    peak transient and the peak of a micro-batch's saved activations, in MiB."""
    out = {f"memory_{k}_bytes_per_param": v for k, v in bytes_per_param(reports, num_params).items()}
    out["memory_transient_peak_mib"] = max(r["transient_peak"] for r in reports) / 2**20
    out["memory_activations_peak_mib"] = max(r.get("activations_peak", 0) for r in reports) / 2**20
    return out


def load_rows(path: Path) -> list[dict]:
    """The rows a run directory's history file holds, one per step (the last written wins:
    steps run again after a restart replace the ones before), in step order."""
    rows: dict[int, dict] = {}
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    rows[row["step"]] = row
    except (OSError, ValueError, KeyError):
        return []
    return [rows[k] for k in sorted(rows)]
