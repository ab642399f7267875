"""The driver's loop: a run is a sequence of states (`states.py`), each returning the next.

    Placing → Building → Resuming → Training → Finishing → Done, with Recovering after any
    failure and Resizing when an elastic run grows back.

The controller holds what the states share and nothing they pass to each other: the config,
the injected policies (failure, scaling, early stopping), the cluster, the dispatcher and the
watchdog it builds groups with, the tracker (the only process that talks to MLflow), the
checkpoints, the history of steps and the run record the summary is made from. Ranks return
plain dicts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.dispatch import DISPATCHERS
from rayzero.cluster.early_stopping import EarlyStopping
from rayzero.cluster.failure import Decision, Failure, FailurePolicy, Stopped
from rayzero.cluster.history import History, load_rows
from rayzero.cluster.record import RecoveryClock, RunRecord
from rayzero.cluster.report import run_summary
from rayzero.cluster.scaling import ScalingPolicy
from rayzero.cluster.schedule import evaluates
from rayzero.cluster.startup import Startup
from rayzero.cluster.recovery import Recovering
from rayzero.objectives.registry import objective_for, remember
from rayzero.cluster.states import Done, Finishing, Placing, State, held, val_values
from rayzero.cluster.watchdog import Watchdog
from rayzero.cluster.worker_group import RayCluster
from rayzero.config import RootConfig
from rayzero.workers.actor import RankActor

log = logging.getLogger(__name__)


class Controller:
    def __init__(self, cfg: RootConfig, data_path: str, run_dir: str, tracker, progress: bool = True,
                 actor_cls=RankActor, checkpoints: Checkpoints | None = None, factory=None, objective=None, spec=None, driver_side=None,
                 startup: Startup | None = None, *, scaling: ScalingPolicy | None = None,
                 failure_policy: FailurePolicy | None = None, early_stopping: EarlyStopping | None = None,
                 cluster=None, dispatcher=None, watchdog=None):
        """`factory`: the model's callable when given from Python; `objective`: the class
        `train.objective` names when given from Python or from the user's files (sent to the
        ranks by value); `spec`: the model seam, for
        writing the final weights (built from `cfg` when not given); `startup`: the run's
        start-up lines, begun by the caller (None: from placement on). The policies, the
        cluster (`RayCluster`), the dispatcher class and the watchdog factory are made from
        `cfg` unless given."""
        self.cfg = cfg
        self.startup = startup or Startup()
        self.factory = factory
        self.objective_cls = objective
        if objective is not None:
            remember(cfg.train.objective, objective)
        self.objective = objective_for(cfg)  # what the driver reads of it: its metrics' merges, its summary
        self.driver_side = driver_side  # the objective's part on the driver (online RL's rollouts), or None
        self.spec = spec
        self.actor_cls = actor_cls
        self.data_path = data_path
        self.run_dir = run_dir
        self.tracker = tracker
        self.progress = progress
        self.checkpoints = checkpoints  # None: checkpoints off
        if checkpoints is not None:
            checkpoints.run = {"data_path": data_path, "dir": run_dir, "mlflow_tracking_uri": tracker.uri}
        t, f = cfg.train, cfg.failure
        self.scaling = scaling or ScalingPolicy.from_config(cfg)
        self.failure_policy = failure_policy or FailurePolicy(cfg, self.scaling)
        self.early = early_stopping or EarlyStopping(t.early_stopping_patience, t.early_stopping_min_delta)
        self.cluster = cluster or RayCluster()
        self.dispatcher = dispatcher or DISPATCHERS[cfg.cluster.dispatch]
        self.make_watchdog = watchdog or (
            lambda actors, on_fire: Watchdog(actors, f.phase_timeout_s, on_fire=on_fire).start())
        self.bundle = cfg.cluster.bundle
        self.validates = bool(cfg.data.val_path or cfg.data.val_fraction)
        self.eval_at_start = self.validates if t.eval_at_start is None else (t.eval_at_start and self.validates)
        self.record = RunRecord(world=self.scaling.start(), schedule_steps=t.steps)
        self.clock = RecoveryClock()
        self.history = History()
        # Every step's row, also on disk: a resumed run's history starts at step 0, not where it resumed.
        self.history_file = Path(run_dir) / "history.jsonl"
        self.history.rows = load_rows(self.history_file)
        self.spares = None  # the warm spares (failure.spares), started with the first group
        self._state: State | None = None
        self._interrupted = False  # a SIGINT arrived (see _catch_interrupts)

    # What the record holds, by the names callers read.
    @property
    def state(self) -> str:
        """The code of the state the run is in (while recovering: the one that failed)."""
        return self._state.code if self._state is not None else "INIT"

    @property
    def world(self) -> int:
        return self.record.world

    @property
    def failures(self) -> list[Failure]:
        return self.record.failures

    @property
    def resizes(self) -> list[dict]:
        return self.record.resizes

    @property
    def pids(self) -> dict[int, int]:
        return self.record.pids

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to `train.steps`, surviving failures (see `states.py`). Ctrl-C: see
        _catch_interrupts."""
        previous_handler = self._catch_interrupts()
        try:
            summary = self._fit()
        except Stopped:
            raise
        except KeyboardInterrupt:  # a second Ctrl-C while the run was ending (the release, MLflow's flush)
            raise self._stopped() from None
        finally:
            for signum, handler in (previous_handler or {}).items():
                signal.signal(signum, handler)
        if self._interrupted:
            log.warning("interrupted after the last step: the run finished and saved everything")
        return summary

    def _fit(self) -> dict:
        status = "FAILED"
        state: State = Placing(self.scaling.start())
        try:
            while not isinstance(state, Done):
                self._state = state
                self.record.states.append(state.code if not isinstance(state, Recovering) else "RECOVER")
                try:
                    state = state.next(self)
                except Exception as exc:
                    if isinstance(state, Recovering):
                        raise  # the policy gave up (or the failure cannot be recovered from)
                    state = Recovering(exc, state)
            self._state = state
            self.record.states.append(state.code)
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise self._stopped() from None
        finally:
            live = held(self._state) if self._state is not None else None
            if live is not None:
                live.release(kill=status != "FINISHED")
            if self.spares is not None:
                self.spares.kill()
            if self.driver_side is not None:
                self.driver_side.close(keep=status == "FINISHED")
            self.tracker.finish(status)
        return self.summary()

    def summary(self) -> dict:
        return {**run_summary(self.cfg, self.record, self.history, self.checkpoints, self.early, self.tracker,
                              self.run_dir, self.objective),
                "startup": self.startup.timings()}

    # -- interrupts --------------------------------------------------------------------------
    def _catch_interrupts(self):
        """Ctrl-C (or a notebook's stop button) stops the run after the iteration in flight;
        after the last step, it lets the run finish as it would have (the final commit, weights,
        MLflow, the summary), since nothing is left to stop.

        SIGTERM (`ray job stop`, Kubernetes stopping a pod; Ray's own handler in a driver dumps
        the stacks and exits) is taken the same way: the iteration in flight ends, one line says
        where the run stopped and what to resume from, MLflow's run is KILLED, nothing is left
        on the cluster.

        A SIGINT that arrives while the main thread waits inside Ray's compiled-graph read can
        be swallowed there; so the handler only takes note, and the loop raises
        KeyboardInterrupt at its next check. A second one raises at once. Returns the handlers
        to restore, by signal (None off the main thread, where signals cannot be handled)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        self._interrupted, self._signal = False, signal.SIGINT

        def on_signal(signum, frame):
            if self._interrupted:
                raise KeyboardInterrupt
            self._interrupted, self._signal = True, signum
            what = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
            again = "Ctrl-C again to stop now" if signum == signal.SIGINT else "a second SIGTERM stops now"
            if self._trained:
                log.warning("%s after the last step: finishing the run (%s)", what, again)
            else:
                log.warning("%s: stopping after the current iteration (%s)", what, again)

        return {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}

    @property
    def _trained(self) -> bool:
        """Every step is trained: the run is only finishing."""
        s = self._state
        return isinstance(s, Done) or (isinstance(s, Finishing) and s.grow is None)

    def stop(self) -> None:
        """Stop the run after the iteration in flight, as a Ctrl-C does (from any thread): `fit`
        raises `Stopped` naming the checkpoint to resume from."""
        self._interrupted = True

    def check_interrupt(self) -> None:
        if self._interrupted:
            raise KeyboardInterrupt

    def _stopped(self) -> Stopped:
        return Stopped(self.record.step, self.last_checkpoint(), finishing=self._trained,
                       signal=int(getattr(self, "_signal", signal.SIGINT)))

    # -- what the states share ------------------------------------------------------------
    def start_spares(self, world: int) -> None:
        """Once, after the first group is placed (so that spares never take a rank's room):
        `failure.spares` standby actors, as many as the cluster holds (a warning says how many)."""
        n = self.cfg.failure.spares
        if n and self.spares is None:
            self.spares = self.cluster.start_spares(
                self.actor_cls, n, self.bundle, lambda: (self.cfg, None, world, self.data_path, self.factory, self.objective_cls))

    def free_ranks(self, settle_s: float = 0.0) -> int:
        """How many more ranks the cluster has room for now."""
        return self.cluster.free(self.bundle, settle_s=settle_s)

    def evaluates(self, k: int) -> bool:
        due = self.checkpoints is not None and self.checkpoints.plan(k) is not None
        return self.validates and evaluates(self.cfg, k, checkpoint_due=due)

    def log_val(self, step: int, val: float, metrics: dict | None, sums: dict | None = None,
                count: float = 0.0) -> None:
        """A validation loss (`sums`: the objective's metrics' merged sums, `count`: what the
        loss was divided by): into `metrics` (this step's row), or at `step` on its own (the
        baseline before the first step)."""
        h = self.history
        values = val_values(self.objective, val, sums, count)
        h.val_steps.append(step)
        h.val_losses.append(val)
        if metrics is not None and step >= 0:
            metrics.update(values)
            return
        self.tracker.log_metrics(step, values)
        self.add_row({"step": step, **values})

    def rewrite_history(self) -> None:
        """history.jsonl as the history now is (after a rewind: without the steps to be trained
        again), replaced at once: never a half-written file."""
        tmp = self.history_file.with_name(self.history_file.name + ".tmp")
        try:
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.history.rows))
            os.replace(tmp, self.history_file)
        except OSError as e:  # as for the appends: a convenience, never a reason to stop training
            log.debug("could not rewrite %s: %s", self.history_file, e)

    def add_row(self, row: dict) -> None:
        self.history.rows.append(row)
        try:  # the on-disk copy is a convenience: a full disk must not stop training
            with open(self.history_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            log.debug("could not append to %s: %s", self.history_file, e)

    def record_failure(self, failure: Failure, decision: Decision) -> None:
        self.record.failures.append(failure)
        n = len(self.record.failures)
        failure.decision, failure.world_size = decision.action, decision.world_size
        text = (f"step {failure.step}: {failure.message} -> {decision.action}"
                + (f" at {decision.world_size} ranks" if decision.action != "give_up" else f" ({decision.reason})"))
        if decision.action != "give_up":
            log.warning("%s %d: %s", "replacement" if decision.action == "replace" else "restart", n, text)
        try:  # MLflow must not turn a recoverable failure into a fatal one
            self.tracker.set_tags({f"failure.{n}": text[:5000], "failure.last_cause": failure.kind})
            if decision.action != "give_up":
                self.tracker.log_metrics(failure.step or self.record.start_step, {"restarts": float(n)})
        except Exception as e:
            log.warning("could not record the failure in MLflow: %s", e)

    def last_checkpoint(self) -> str | None:
        """What a rerun resumes from: this run's last commit, else the one it resumed from."""
        if self.checkpoints is None:
            return None
        rec = self.record
        return self.checkpoints.last_committed or rec.resumed_from or (rec.first_start or (0, None))[1]
