"""Where checkpoints go, how often, how many are kept, and what a run resumes from."""

from __future__ import annotations

from pydantic import ConfigDict, Field, SecretStr, field_validator

from rayzero._frozen import Frozen


class CheckpointConfig(Frozen):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, populate_by_name=True)

    # A local path, file://… or s3://bucket/prefix; relative paths are under train.output_dir.
    # Empty disables checkpoints.
    dir: str = "checkpoints"
    every_steps: int = Field(default=50, ge=0)  # 0: only at the end of training
    keep_last: int = Field(default=2, ge=1)  # committed checkpoints kept; older ones are deleted
    resume: str = "auto"  # auto: the newest committed checkpoint in `dir`; none; or a checkpoint URI
    async_: bool = Field(default=True, alias="async")  # upload in the background while training goes on
    # S3: unset fields fall back to the standard AWS variables (AWS_ACCESS_KEY_ID, …).
    s3_endpoint: str = ""  # host:port or a URL, e.g. http://127.0.0.1:8333
    s3_region: str = ""
    s3_access_key_id: str = ""
    s3_secret_access_key: SecretStr = SecretStr("")
    retries: int = Field(default=5, ge=0)  # per storage call, with exponential backoff

    @field_validator("resume")
    @classmethod
    def _resume(cls, v: str) -> str:
        if not v:
            raise ValueError("checkpoint.resume: expected auto, none, or a checkpoint URI")
        return v
