"""Where checkpoints go, how often, how many are kept, and what a run resumes from."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, SecretStr, field_validator

from rayzero._frozen import Frozen


class CheckpointConfig(Frozen):
    """Where checkpoints go, how often, how many are kept, and what a run resumes from. The S3
    settings are those of every `s3://` URI (`model.path`, `data.path`, `train.save_final`, and
    `rayzero ckpt`, `generate` and `data prepare`, which take them as overrides); left empty they
    fall back to the standard AWS variables (`AWS_ACCESS_KEY_ID`, ...)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, populate_by_name=True)

    dir: str = Field(
        default="checkpoints",
        description="A local path, `file://...` or `s3://bucket/prefix`; relative paths are under "
        "`train.output_dir`. Empty disables checkpoints.",
    )
    every_steps: int = Field(
        default=50, ge=0,
        description="Save a checkpoint every this many steps, and always after the last one; 0 = only at "
        "the end of training.",
    )
    keep_last: int = Field(
        default=2, ge=1,
        description="Committed checkpoints kept; older ones are deleted.",
    )
    keep_best: Literal["", "val_loss"] = Field(
        default="",
        description="`val_loss`: also keep the checkpoint with the lowest validation loss, which rotation never "
        "deletes (every checkpoint step then evaluates); empty = keep only the last `keep_last`.",
    )
    resume: str = Field(
        default="auto",
        description="What a run starts from: `auto` = the newest committed checkpoint in `dir` (none: "
        "from scratch); `none` = from scratch; or a checkpoint URI.",
    )
    async_: bool = Field(
        default=True, alias="async",
        description="Upload checkpoints in the background while training goes on; `false` waits for each "
        "upload.",
    )
    s3_endpoint: str = Field(
        default="",
        description="S3 endpoint, `host:port` (https) or a URL, e.g. `http://127.0.0.1:8333`; empty = "
        "`$AWS_ENDPOINT_URL_S3` or `$AWS_ENDPOINT_URL` if set, else AWS.",
    )
    s3_region: str = Field(
        default="",
        description="S3 region; empty = the AWS default.",
    )
    s3_access_key_id: str = Field(
        default="",
        description="S3 access key id; empty = the standard AWS credentials.",
    )
    s3_secret_access_key: SecretStr = Field(
        default=SecretStr(""),
        description="S3 secret access key, used together with `s3_access_key_id`; masked wherever the "
        "config is shown.",
    )
    s3_session_token: SecretStr = Field(
        default=SecretStr(""),
        description="S3 session token of temporary credentials, with `s3_access_key_id`; empty = "
        "`$AWS_SESSION_TOKEN` where the keys come from the environment; masked wherever the config is shown.",
    )
    s3_create_bucket: bool = Field(
        default=False,
        description="Create the bucket of an `s3://` URI written to (checkpoints, exports, `data prepare`) "
        "when it does not exist; false = refuse, naming the bucket, so that a misspelt name is an error "
        "rather than a new bucket and a fresh run.",
    )
    retries: int = Field(
        default=5, ge=0,
        description="Retries per storage call, with exponential backoff; 0 = no retries.",
    )

    @property
    def storage(self):
        """The S3 settings and retries as `rayzero.storage` takes them (`StorageSettings`)."""
        from rayzero.storage import StorageSettings  # here, not above: the config imports no pyarrow

        return StorageSettings(endpoint=self.s3_endpoint, region=self.s3_region, access_key_id=self.s3_access_key_id,
                               secret_access_key=self.s3_secret_access_key.get_secret_value(),
                               session_token=self.s3_session_token.get_secret_value(),
                               create_bucket=self.s3_create_bucket, retries=self.retries)

    def with_environment(self, env=None) -> "CheckpointConfig":
        """These settings with their empty S3 fields taken from the standard AWS variables of
        this process (`env`: os.environ): what a run's driver resolves once, and gives its ranks,
        processes Ray starts without this environment on machines that may not have it; the
        driver's probe write then proves what the ranks will do. The keys come as a pair (with
        their session token), or not at all."""
        import os

        env = os.environ if env is None else env
        fill: dict = {}
        if not self.s3_endpoint:
            fill["s3_endpoint"] = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
        if not self.s3_region:
            fill["s3_region"] = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or ""
        if not self.s3_access_key_id and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            fill.update(s3_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        s3_secret_access_key=SecretStr(env["AWS_SECRET_ACCESS_KEY"]),
                        s3_session_token=SecretStr(env.get("AWS_SESSION_TOKEN", "")))
        return self.model_copy(update={k: v for k, v in fill.items() if v})

    @field_validator("resume")
    @classmethod
    def _resume(cls, v: str) -> str:
        if not v:
            raise ValueError("checkpoint.resume: expected auto, none, or a checkpoint URI")
        return v
