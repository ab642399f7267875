"""Configuration of the Ray side: where the ranks run and how the controller reaches them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rayzero._frozen import Frozen


class ClusterConfig(Frozen):
    """Where the ranks run: how many, on which Ray cluster, with what resources, and how the
    controller drives them."""

    num_workers: int = Field(
        default=2, ge=1,
        description="Ranks to train with, one Ray actor each: the world size, `parallel.pp` x `sharding.dp_outer` x "
        "shards x `parallel.ep` x `parallel.cp` x `parallel.tp`; the data-parallel size is it / (`parallel.pp` x "
        "`parallel.cp` x `parallel.tp`).",
    )
    min_workers: int | None = Field(
        default=None, ge=1,
        description="Elastic training: when fewer ranks can be placed, the run continues with the largest "
        "world size down to this one that keeps the global batch divisible, and grows back at a checkpoint "
        "when the resources return. `null` = `num_workers` (no shrinking).",
    )
    address: str = Field(
        default="",
        description="The Ray cluster: empty starts a local Ray; `auto` or `host:port` joins a running one.",
    )
    use_gpu: bool = Field(
        default=False,
        description="Give each rank one GPU and train on CUDA; `false` trains on CPU.",
    )
    cpus_per_worker: float = Field(
        default=1.0, gt=0,
        description="CPUs Ray reserves for each rank; may be fractional.",
    )
    dashboard: bool = Field(
        default=False,
        description="Start Ray's dashboard with the local Ray this run starts (no `cluster.address`): its web UI "
        "on 127.0.0.1:8265, the state API and `ray job`. Left out by default, as a run needs none of it and it "
        "costs about 2 s of the start; a cluster the run joins keeps its own.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK",
        description="Ray placement-group strategy for the ranks: `PACK` keeps them on as few nodes as "
        "possible, `SPREAD` spreads them across nodes; `STRICT_PACK` requires a single node, `STRICT_SPREAD` "
        "a node per rank.",
    )
    placement_timeout_s: float = Field(
        default=60.0, gt=0,
        description="Seconds to wait for Ray to place the ranks; then the run shrinks (see `min_workers`) "
        "or fails: it never hangs on resources.",
    )
    keep_ranks: bool = Field(
        default=False,
        description="Keep the rank processes (and their placement group) when a run ends well, for the next "
        "run in the same Python process with the same placement (a notebook's next `fit()`, a sweep): it starts "
        "without starting processes or importing torch and the model's code again, its ranks made anew. The kept "
        "ranks hold their resources while idle; `rayzero.release_ranks()`, a run with another placement, or the "
        "process's end frees them. Online RL's rollout actors are kept beside them, for a run with as many "
        "rollout actors of the same bundle (a run without rollouts frees them).",
    )
    pg_timeout_s: float = Field(
        default=300.0, gt=0,
        description="Timeout of each torch.distributed collective, in seconds.",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="torch.distributed backend; `auto` = `nccl` with GPUs, else `gloo`.",
    )
    dispatch: Literal["compiled", "chained"] = Field(
        default="compiled",
        description="How the controller runs an iteration's phases on the ranks: `compiled` = one Ray "
        "Compiled Graph, built once; `chained` = every phase submitted at once with `.remote()`, each fed the "
        "one before, the fallback where compiled graphs are unavailable (`pipelined`, its old name, is read as "
        "`chained`).",
    )

    @field_validator("dispatch", mode="before")
    @classmethod
    def _old_dispatch_name(cls, v):
        return "chained" if v == "pipelined" else v

    @property
    def bundle(self) -> dict[str, float]:
        """The resources one rank takes: a bundle of the run's placement group."""
        return {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}


class TrackingConfig(Frozen):
    """MLflow tracking of each run's parameters and metrics."""

    enabled: bool = Field(default=True, description="Log parameters and metrics to MLflow.")
    uri: str = Field(
        default="",
        description="MLflow tracking URI; empty = `$MLFLOW_TRACKING_URI`, else a sqlite file in the run "
        "directory.",
    )
    experiment: str = Field(
        default="rayzero",
        description="MLflow experiment the run is logged under; created when missing.",
    )
    run_name: str = Field(
        default="",
        description="Name of the run and of its directory under `train.output_dir` (a `-1`, `-2`, ... "
        "suffix is added when it exists); empty = the start time, `YYYYmmdd-HHMMSS`.",
    )
    flush_timeout_s: float = Field(
        default=30.0, ge=0,
        description="At the end of a run, how long to wait for a slow or unreachable tracking server to "
        "take the metrics kept while it did not answer; what is left is written to "
        "`mlflow-unsent.json` in the run directory, which the next run of that directory (or `rayzero tracking "
        "send RUN_DIR`) sends into the same MLflow run.",
    )


class FailureConfig(Frozen):
    """What happens when a rank dies, a collective fails or a phase hangs: the group is torn
    down and rebuilt from the newest committed checkpoint, up to `max_restarts` times."""

    max_restarts: int = Field(
        default=3, ge=-1,
        description="Restarts after failures before the run gives up; -1 = unlimited.",
    )
    phase_timeout_s: float = Field(
        default=60.0, gt=0,
        description="Watchdog, in seconds: the longest one rank may spend in one phase or checkpoint load "
        "(waiting on its upload: since the upload last moved a block) before the run counts it as hung "
        "and restarts. A rank still starting (its actor's constructor, then `setup`: joining the group, "
        "building the model, reading its weights) gets at least 60 s, and an iteration that compiles "
        "(`train.compile`: the first after a start, the first that evaluates) at least 300 s.",
    )
    backoff_s: float = Field(
        default=1.0, ge=0,
        description="Seconds to wait before a restart, doubling with each failure until a checkpoint "
        "commits; 0 = restart at once.",
    )
    backoff_max_s: float = Field(
        default=30.0, ge=0,
        description="Upper bound on the wait before a restart, in seconds.",
    )
    spares: int = Field(
        default=0, ge=0,
        description="Warm spare ranks kept on standby, each a Ray actor of a rank's resources with torch "
        "imported and the model's code loaded: when a rank is lost, a spare takes its place and the run goes "
        "on at the same world size from the newest commit, without restarting the other ranks. Spares the "
        "cluster cannot hold are left out, with a warning; 0 = no spares (a failure restarts every rank).",
    )
