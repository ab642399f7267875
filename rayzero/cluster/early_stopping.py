"""Early stopping: end the run when the validation loss stops improving.

A policy that returns decisions (the controller acts on them): `observe` each evaluation's
loss, in step order; it says when `patience` evaluations in a row have not improved on the
best so far by more than `min_delta`. Its state goes into every checkpoint's manifest, so a
resumed run counts on from where it stopped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EarlyStopping:
    patience: int  # 0: never stop
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None  # the step the best loss was evaluated after (-1: before the first)
    since_best: int = 0  # evaluations since the best one
    stopped: str | None = None  # why the run stopped early, once it has
    stopped_after: int | None = None  # the step it stopped after

    def observe(self, step: int, val_loss: float) -> bool:
        """An evaluation after `step`; True when the run should stop after it."""
        if self.best is None or val_loss < self.best - self.min_delta:
            self.best, self.best_step, self.since_best = val_loss, step, 0
        else:
            self.since_best += 1
        if self.patience and self.since_best >= self.patience:
            self.stopped = (f"no improvement on the validation loss {self.best:.4f} (after step {self.best_step}) by "
                            f"more than {self.min_delta:g} in {self.since_best} evaluations "
                            f"(train.early_stopping_patience={self.patience})")
            self.stopped_after = step
            return True
        return False

    def may_stop_next(self) -> bool:
        """Whether the next evaluation can end the run (so its step should be committed)."""
        return bool(self.patience) and self.since_best + 1 >= self.patience

    def state(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("patience", "min_delta")}

    def restore(self, state: dict | None) -> None:
        """Continue from a checkpoint's record (none: from scratch)."""
        state = state or {}
        self.best, self.best_step = state.get("best"), state.get("best_step")
        self.since_best, self.stopped = state.get("since_best", 0), state.get("stopped")
        self.stopped_after = state.get("stopped_after")
