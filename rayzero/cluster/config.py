"""Configuration of the Ray side: where the ranks run and how the controller reaches them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rayzero._frozen import Frozen


class ClusterConfig(Frozen):
    num_workers: int = Field(default=2, ge=1)  # ranks, one Ray actor each
    # Elastic: below num_workers, a run continues with fewer ranks when only fewer can be
    # placed (the largest world that keeps the global batch divisible), and grows back at a
    # checkpoint when the resources return. None = num_workers (no shrinking).
    min_workers: int | None = Field(default=None, ge=1)
    address: str = ""  # empty = start a local Ray; "auto" or host:port = join a running one
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=1.0, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = Field(default=60.0, gt=0)  # then shrink or fail: never hang on resources
    pg_timeout_s: float = Field(default=300.0, gt=0)  # torch.distributed collective timeout
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto = nccl with GPUs, else gloo
    dispatch: Literal["compiled", "pipelined"] = "compiled"


class TrackingConfig(Frozen):
    enabled: bool = True
    uri: str = ""  # empty = $MLFLOW_TRACKING_URI, else a sqlite file in the run directory
    experiment: str = "rayzero"
    run_name: str = ""


class FailureConfig(Frozen):
    """What happens when a rank dies, a collective fails or a phase hangs: the group is torn
    down and rebuilt from the newest committed checkpoint, up to `max_restarts` times."""

    max_restarts: int = Field(default=3, ge=-1)  # -1: unlimited
    # Watchdog: the longest one rank may spend in one phase or checkpoint load (waiting on its
    # upload: since the upload last moved a block) before the run counts it as hung; torch's
    # own collective timeout is 30 minutes.
    phase_timeout_s: float = Field(default=60.0, gt=0)
    backoff_s: float = Field(default=1.0, ge=0)  # wait before a restart, doubling while none commits
    backoff_max_s: float = Field(default=30.0, ge=0)
