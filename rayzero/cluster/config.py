"""Configuration of the Ray side: where the ranks run and how the controller reaches them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rayzero._frozen import Frozen


class ClusterConfig(Frozen):
    num_workers: int = Field(default=2, ge=1)  # ranks, one Ray actor each
    address: str = ""  # empty = start a local Ray; "auto" or host:port = join a running one
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=1.0, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = Field(default=60.0, gt=0)  # then fail: never hang on resources
    pg_timeout_s: float = Field(default=300.0, gt=0)  # torch.distributed collective timeout
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto = nccl with GPUs, else gloo
    dispatch: Literal["compiled", "pipelined"] = "compiled"


class TrackingConfig(Frozen):
    enabled: bool = True
    uri: str = ""  # empty = $MLFLOW_TRACKING_URI, else a sqlite file in the run directory
    experiment: str = "rayzero"
    run_name: str = ""
