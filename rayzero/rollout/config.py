"""The rollout actors' section of the config (`rollout.`), read without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rayzero._frozen import Frozen


class RolloutConfig(Frozen):
    """Where an online RL run's completions come from: `workers` Ray actors of their own, each
    holding the whole policy, refreshed with the trained weights after every optimizer step."""

    workers: int = Field(default=1, ge=1, description="Rollout actors; a round's prompts are spread over them "
                         "(what a completion is does not depend on how many there are).")
    engine: Literal["transformers", "replay"] = Field(
        default="transformers",
        description="`transformers`: sampling with a KV cache through the policy (transformers' models, on CPU or "
        "a GPU); `replay`: recorded completions read from `rollout.replay` instead (debugging, offline RL, "
        "equality tests).",
    )
    replay: str = Field(
        default="",
        description="With rollout.engine=replay: JSON lines of {round, prompt, prompt_ids (optional), index, "
        "completion_ids}; a round's prompts and their order are the file's.",
    )
    cpus_per_worker: float = Field(default=1.0, gt=0, description="CPUs each rollout actor's placement bundle "
                                   "reserves.")
    gpus_per_worker: float = Field(default=0.0, ge=0, description="GPUs each rollout actor's bundle reserves "
                                   "(0: it generates on CPU).")
