"""MLflow from the controller alone, never in training's way.

Every MLflow call goes through a queue to one background thread, in order. A tracking server
that is down or slow holds up that thread, not training: the thread warns once, keeps what is
queued, retries with backoff, and sends it all when the server answers. At the end the run
waits `flush_timeout_s` for the queue to drain; what still has not gone is written to a JSON
file in the run directory, and the warning says where.

What was written there is sent later, into the same run: the next run or resume of the same
run directory (`unsent`) sends it first, before anything of its own, and `rayzero tracking send
RUN_DIR` sends it without training. The file keeps the run itself (its params, tags and config
artifact), not only the metrics, for a server that was down from the start; it is deleted once
all of it is sent.

When training goes back to a commit and trains the steps after it again (a rerun after Ctrl-C,
a restart after a failure), `rewind` supersedes their earlier points, in order with the rest:
a SQL store (the default sqlite file) loses them, so the run holds one point per step; a
tracking server, which has no API for it, keeps them and a run tag says which they are.

A run's tracker is made `held`: its thread queues everything but touches MLflow (its import,
the store, the run) only once the run's start-up is over (`begin`, at the end of the first
step), so that it takes no CPU from the ranks' start (on 2 cores the first step came 2.2 s
later with MLflow on than off; `benchmarks/startup.py`). Until then `run_id` is None at once.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

UNSENT = "mlflow-unsent.json"  # in the run directory: what the server did not take in time
_PARAM_BATCH = 100  # MLflow's limit on params per log_batch call
_METRIC_BATCH = 1000  # … and on metrics
_START_WAIT_S = 2.0  # how long reading `run_id` waits to learn it (never longer)
_HELD_MAX_S = 30.0  # a held tracker begins by then even if the first step has not come
_RETRY_MAX_S = 30.0


class Tracker:
    def __init__(self, uri: str, experiment: str, run_name: str, params: dict, tags: dict, *,
                 artifact_dir: str | None = None, artifacts: list[str] = (), spill_path: str | None = None,
                 flush_timeout_s: float = 30.0, resume: tuple[str | None, int] | None = None,
                 unsent: str | None = None, own_run: bool = True, held: bool = False):
        """`resume`: (the MLflow run id a checkpoint recorded, its step): that run goes on, if
        this store has it, rather than a new one starting. `unsent`: a file an earlier tracker
        of this run spilled (`_spill`), sent first, into the run it was for (the run this one
        then goes on with), and deleted once sent. `own_run=False`: only that (`send_unsent`).
        `held`: MLflow is not touched before `begin()` (or `finish()`, or _HELD_MAX_S)."""
        self.uri = uri
        self.resume = resume
        self._run_id: str | None = None
        self.spill_path = spill_path
        self.spilled_to: str | None = None  # set when metrics had to be written there instead
        self.flush_timeout_s = flush_timeout_s
        # MLflow's own HTTP retries would hold one call for minutes; the thread retries instead.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.client = None  # made by the thread: MLflow's import takes a second of the run's start-up
        self._queue: queue.Queue = queue.Queue()
        self._pending: list[tuple] = []  # taken from the queue, not yet sent
        self._started = threading.Event()  # the run exists: run_id is known
        self._begun = threading.Event()  # MLflow may be used (a held tracker waits for `begin`)
        self._ready = threading.Event()  # MLflow imported and its client made (or that failed)
        if not held:
            self._begun.set()
        self._stop = threading.Event()
        self._warned = False
        self._warned_rewind = False
        earlier = load_unsent(unsent)
        if earlier is not None:
            self._run_id = earlier["run_id"]  # the run it was for, where the server had it; else its start makes it
            # a run resumed at step k trains the steps from k again: their first points never go (a
            # tracking server could not take them back), so the run holds one point per step there too
            cut = (resume[1] if resume[1] > 0 else -1) if resume is not None else None
            for op in earlier["ops"]:
                if op[0] == "metrics" and cut is not None:
                    op = ("metrics", [m for m in op[1] if m[3] < cut])
                if op[0] != "end":  # the run goes on (or `send_unsent` ends it as it ended)
                    self._queue.put(op)
            self._queue.put(("sent", unsent))
        if own_run:  # as MLflow takes them, strings (a secret masked, as its str() is): so the file keeps them too
            self._queue.put(("start", experiment, run_name, {k: str(v) for k, v in params.items()},
                             {k: str(v) for k, v in tags.items()}, artifact_dir))
            for path in artifacts:
                self._queue.put(("artifact", str(path)))
        self._thread = threading.Thread(target=self._run, name="rayzero-mlflow", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id, once the thread has it (waits a little for it: None if the
        server has not answered by then; None at once while the tracker is held)."""
        if self._begun.is_set():  # MLflow's import and its store first: this process's own work
            deadline = time.monotonic() + _HELD_MAX_S
            while not self._ready.wait(0.1) and self._thread.is_alive() and time.monotonic() < deadline:
                pass
            self._started.wait(_START_WAIT_S)  # the server's answer
        return self._run_id

    def begin(self) -> None:
        """The run's start-up is over: a held tracker goes to MLflow with what it has queued."""
        self._begun.set()

    # -- what the controller calls: never blocks on the server -------------------------
    # The queue holds plain values: MLflow is imported by the thread alone (an import of it here,
    # while the thread imports it, can find its modules half made).
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        self._queue.put(("metrics", [(k, float(v), ts, step) for k, v in metrics.items()]))

    def set_tags(self, tags: dict) -> None:
        self._queue.put(("tags", {k: str(v) for k, v in tags.items()}))

    def rewind(self, step: int, metrics: list[str], tags: list[str] = ()) -> None:
        """Training went back to `step` and trains the steps from it again: the points of
        `metrics` logged so far at `step` and after (from step 0, the evaluation before it at
        step -1 too) are superseded, and so are `tags`. Applies to what was queued before it,
        never to the points logged after it."""
        lowest = step if step > 0 else -1
        self._queue.put(("rewind", step, lowest, list(metrics), list(tags), int(time.time() * 1000)))

    def finish(self, status: str = "FINISHED") -> None:
        """Close the run with `status` (FINISHED, FAILED or KILLED) once everything queued
        before has been sent; after `flush_timeout_s`, spill what is left to a file."""
        self._queue.put(("end", status))
        self.begin()
        deadline = time.monotonic() + self.flush_timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(timeout=0.1)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=15)
            self._spill()

    # -- the background thread ----------------------------------------------------------
    def _run(self) -> None:
        self._begun.wait(_HELD_MAX_S)
        delay = 1.0
        while True:
            if not self._pending:
                self._pending = [self._queue.get()]
                while not self._queue.empty() and len(self._pending) < 256:
                    self._pending.append(self._queue.get_nowait())
            try:
                ended = self._send_pending()
            except Exception as e:  # the server is down or slow: keep the rest, try again
                self._ready.set()
                if self._stop.is_set():
                    return
                self._started.set()  # nobody waits for a run id that is not coming soon
                if not self._warned:
                    log.warning("MLflow at %s does not answer (%s); training goes on and the metrics are kept "
                                "and sent when it does. Check tracking.uri (or MLFLOW_TRACKING_URI), or set "
                                "tracking.enabled=false.",
                                self.uri, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                    self._warned = True
                self._stop.wait(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            if self._warned and self.run_id:
                log.warning("MLflow at %s answers again; the kept metrics are sent", self.uri)
                self._warned = False
            delay = 1.0
            if ended:
                return

    def _send_pending(self) -> bool:
        """Send from the front of the pending ops, dropping each once the server has taken it,
        so a failure leaves exactly the unsent rest (the failed one first) for the retry.
        Consecutive metrics go in one call, within MLflow's limit. True once the run is ended."""
        from mlflow.entities import Metric

        if self.client is None:
            from mlflow.tracking import MlflowClient

            seed_sqlite_store(self.uri)
            self.client = MlflowClient(tracking_uri=self.uri)
            self._ready.set()
        ops = self._pending
        while ops:
            n = 1
            if ops[0][0] == "metrics":
                batch = list(ops[0][1])
                while n < len(ops) and ops[n][0] == "metrics" and len(batch) + len(ops[n][1]) <= _METRIC_BATCH:
                    batch += ops[n][1]
                    n += 1
                self.client.log_batch(self.run_id, metrics=[Metric(*m) for m in batch])
            else:
                self._send_one(ops[0])
            ended = ops[0][0] == "end"
            del ops[:n]
            if ended:
                return True
        return False

    def _send_one(self, op: tuple) -> None:
        from mlflow.entities import Param, RunTag

        kind = op[0]
        if kind == "start":
            _, experiment, run_name, params, tags, artifact_dir = op
            if self._run_id is not None:  # the run an earlier tracker of this run left values for: it goes on
                self.resume = (self._run_id, self.resume[1] if self.resume else 0)
                self._run_id = None
            if self._run_id is None and self.resume is not None and self._continue(params, tags):
                return
            if self._run_id is None:
                if self.resume is not None and self.resume[0]:
                    tags = {**tags, "resumed_from_run": self.resume[0]}  # a run in another store
                exp = self.client.get_experiment_by_name(experiment)
                exp_id = exp.experiment_id if exp else self.client.create_experiment(
                    experiment, artifact_location=Path(artifact_dir).resolve().as_uri() if artifact_dir else None)
                run = self.client.create_run(exp_id, run_name=run_name or None,
                                             tags={k: str(v) for k, v in tags.items()})
                self._run_id = run.info.run_id
                self._started.set()
            items = [Param(k, str(v)) for k, v in sorted(params.items())]
            for i in range(0, len(items), _PARAM_BATCH):
                self.client.log_batch(self.run_id, params=items[i : i + _PARAM_BATCH])
        elif kind == "tags":
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in op[1].items()])
        elif kind == "artifact":
            self.client.log_artifact(self.run_id, op[1])
        elif kind == "rewind":
            self._rewind(*op[1:])
        elif kind == "end":
            self.client.set_terminated(self.run_id, status=op[1])
        elif kind == "sent":  # everything an earlier tracker left is in: its file goes
            Path(op[1]).unlink(missing_ok=True)
            log.warning("MLflow at %s took the values an earlier run left in %s", self.uri, op[1])

    def _continue(self, params: dict, tags: dict) -> bool:
        """Go on with the resumed run in this store, if it has it: RUNNING again, the params
        it lacks logged, and those that differ now (MLflow keeps a param's first value) noted
        in a tag. False when the store does not have the run."""
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        run_id, step = self.resume
        if not run_id:
            return False
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return False
        if run.info.lifecycle_stage != "active":
            return False
        self._run_id = run_id
        self._started.set()
        self.client.update_run(run_id, status="RUNNING")
        before = run.data.params
        items = [Param(k, str(v)) for k, v in sorted(params.items()) if k not in before]
        for i in range(0, len(items), _PARAM_BATCH):
            self.client.log_batch(run_id, params=items[i : i + _PARAM_BATCH])
        changed = [f"{k}: {before[k]} -> {v}" for k, v in sorted(params.items()) if k in before and before[k] != str(v)]
        notes = {f"resumed_at_step_{step}": "; ".join(changed) if changed else "same params"}
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)[:5000]) for k, v in {**tags, **notes}.items()])
        return True

    def _rewind(self, step: int, lowest: int, keys: list[str], tags: list[str], at_ms: int) -> None:
        """Take the superseded points out where the store allows it (MLflow has no API to
        delete points: mlflow/mlflow#2973); where it does not, keep them and say so in a tag."""
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        present = self.client.get_run(self.run_id).data.tags if tags else {}
        for key in tags:
            if key in present:
                self.client.delete_tag(self.run_id, key)
        store = self.client._tracking_client.store  # the client's own store object: no public accessor
        if isinstance(store, SqlAlchemyStore):
            delete_points(store.engine, self.run_id, keys, lowest)
            return
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at_ms / 1000))
        self.client.set_tag(self.run_id, f"rewound_at_step_{step}",
                            f"points for steps >= {lowest} logged before {when} (timestamp {at_ms} ms) were "
                            "trained again: the points logged after that replace them")
        if not self._warned_rewind:
            log.warning("MLflow at %s cannot delete metric points, so the points of the steps trained again "
                        "stay next to the new ones; the run's rewound_at_step_%d tag says which (history.jsonl "
                        "in the run directory holds one row per step)", self.uri, step)
            self._warned_rewind = True

    def _spill(self) -> None:
        """What never reached the server, as JSON in the run directory: every operation left, in
        order (`ops`: the run's start with its params and tags where the server never had it,
        artifacts, metrics, tags, rewinds, its end), which a later tracker sends (`unsent`);
        and, to read, one point per step (`metrics`) and the rewinds the server never got."""
        left = [op for op in self._pending + list(self._drain()) if op[0] != "sent"]
        rows, rewinds = [], []
        for op in left:
            if op[0] == "metrics":
                rows += [{"key": key, "value": value, "step": step, "timestamp": ts} for key, value, ts, step in op[1]]
            elif op[0] == "rewind":
                _, step, lowest, keys, _, at_ms = op
                rows = [r for r in rows if r["step"] < lowest or r["key"] not in keys]
                rewinds.append({"step": step, "before_ms": at_ms})
        if not self.spill_path:
            log.warning("MLflow at %s never answered; %d metric values were not sent", self.uri, len(rows))
            return
        tmp = Path(self.spill_path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"tracking_uri": self.uri, "run_id": self._run_id, "ops": [list(op) for op in left],
                                   "metrics": rows, "rewinds": rewinds}, indent=1))
        os.replace(tmp, self.spill_path)
        self.spilled_to = self.spill_path
        log.warning("MLflow at %s did not take the last %d metric values within %.0fs; they are in %s",
                    self.uri, len(rows), self.flush_timeout_s, self.spill_path)

    def _drain(self):
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return


def load_unsent(path: str | None) -> dict | None:
    """What a tracker spilled to `path` (`Tracker._spill`): {"tracking_uri", "run_id", "ops"},
    the ops as the queue holds them; None where there is no such file. A file from before the
    ops were kept holds the metrics alone: those are sent."""
    if not path or not Path(path).is_file():
        return None
    try:
        kept = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s): its values are not sent", path, e)
        return None
    ops = kept.get("ops")
    if ops is None:
        ops = [["metrics", [[m["key"], m["value"], m["timestamp"], m["step"]] for m in kept.get("metrics", [])]]]
    return {"tracking_uri": kept.get("tracking_uri"), "run_id": kept.get("run_id"),
            "ops": [_as_op(op) for op in ops]}


def _as_op(op: list) -> tuple:
    """An operation read back from JSON, as the queue holds it (metrics as tuples)."""
    if op[0] == "metrics":
        return ("metrics", [tuple(m) for m in op[1]])
    return tuple(op)


def send_unsent(path: str, uri: str | None = None, timeout_s: float = 60.0) -> dict:
    """`rayzero tracking send`: what a run left in `path` (its run directory's
    mlflow-unsent.json), sent to its tracking URI (or `uri`) without training: the run made
    where the server never had it, ended as the run ended. {"run_id", "sent": bool}."""
    kept = load_unsent(path)
    if kept is None:
        raise FileNotFoundError(path)
    if not kept["run_id"] and not any(op[0] == "start" for op in kept["ops"]):
        raise ValueError(f"{path} names no MLflow run to send its values to (a file from before runs were kept "
                         "in it)")
    ends = [op[1] for op in kept["ops"] if op[0] == "end"]
    t = Tracker(uri or kept["tracking_uri"], "", "", {}, {}, spill_path=path, flush_timeout_s=timeout_s,
                unsent=path, own_run=False)
    t.finish(ends[-1] if ends else "FINISHED")
    return {"run_id": t._run_id, "sent": not Path(path).exists()}


def seed_sqlite_store(uri: str) -> None:
    """A new sqlite store (the default, one per run directory) starts as a copy of an empty one
    with MLflow's schema, made once per MLflow version in rayzero's cache: MLflow would run its
    ~60 schema migrations (1.5 s of CPU) for every new run directory. The copy is what those
    migrations make (MLflow adds its Default experiment when it opens the store, as it would);
    anything else (an existing file, another database, the cache not writable) is left to MLflow."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///").split("?")[0])
    if not path.parent.is_dir() or path.exists():
        return
    import mlflow
    from mlflow.store.db.utils import _initialize_tables  # what MLflow runs on an empty database
    from sqlalchemy import create_engine

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rayzero"
    template = cache / f"mlflow-{mlflow.__version__}-schema.db"
    try:
        if not template.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            part = cache / f".{template.name}.{os.getpid()}.{threading.get_ident()}"
            engine = create_engine(f"sqlite:///{part}")
            try:
                _initialize_tables(engine)
            finally:
                engine.dispose()
            os.replace(part, template)  # whole or not at all, for other runs making it at once
        part = path.with_name(f".{path.name}.{os.getpid()}.seed")
        shutil.copyfile(template, part)
        try:
            os.link(part, path)  # never over a store that appeared meanwhile
        finally:
            part.unlink()
    except Exception as e:  # MLflow makes the schema itself, as without the cache
        log.debug("no seeded MLflow store at %s: %s", path, e)


def delete_points(engine, run_id: str, keys: list[str], lowest: int) -> None:
    """In an MLflow SQL store (`engine`): the run's points of `keys` at step `lowest` and after
    gone, and each key's latest value (the run page's, `run.data.metrics`) back to its newest
    point left, chosen as MLflow chooses it: highest step, then timestamp, then value."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from sqlalchemy import delete, select, update

    points, latest = SqlMetric.__table__, SqlLatestMetric.__table__
    run = points.c.run_uuid == run_id
    with engine.begin() as db:
        db.execute(delete(points).where(run & points.c.key.in_(keys) & (points.c.step >= lowest)))
        for key in keys:
            newest = db.execute(select(points.c.value, points.c.timestamp, points.c.step, points.c.is_nan)
                                .where(run & (points.c.key == key))
                                .order_by(points.c.step.desc(), points.c.timestamp.desc(), points.c.value.desc())
                                .limit(1)).first()
            row = (latest.c.run_uuid == run_id) & (latest.c.key == key)
            if newest is None:
                db.execute(delete(latest).where(row))
            else:
                db.execute(update(latest).where(row).values(**newest._mapping))


class NullTracker:
    """Stands in when tracking.enabled is false."""

    uri = ""
    run_id = ""
    spilled_to = None

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def set_tags(self, tags: dict) -> None:
        pass

    def rewind(self, step: int, metrics: list[str], tags: list[str] = ()) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass
