"""MLflow from the controller alone: parameters once, metrics batched and asynchronous."""

from __future__ import annotations

import time

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

_PARAM_BATCH = 100  # MLflow's limit on params per log_batch call


class Tracker:
    def __init__(self, uri: str, experiment: str, run_name: str, params: dict, tags: dict):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        run = self.client.create_run(
            exp_id, run_name=run_name or None, tags={k: str(v) for k, v in tags.items()}
        )
        self.run_id = run.info.run_id
        items = [Param(k, str(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), _PARAM_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _PARAM_BATCH])
        self._pending = []

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Queue one step's metrics; MLflow's async logger batches and writes them."""
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        self._pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))

    def set_tags(self, tags: dict) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def finish(self, status: str = "FINISHED") -> None:
        """Wait for queued metrics, then close the run with `status` (FINISHED or FAILED)."""
        for op in self._pending:
            if op is not None:
                op.wait()
        self._pending = []
        self.client.set_terminated(self.run_id, status=status)


class NullTracker:
    """Stands in when tracking.enabled is false."""

    uri = ""
    run_id = ""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def set_tags(self, tags: dict) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass
