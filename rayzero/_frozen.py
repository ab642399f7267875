"""The base every component config derives from: frozen, closed to unknown keys."""

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
