"""The rollout actors' section of the config (`rollout.`), read without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rayzero._frozen import Frozen


class RolloutConfig(Frozen):
    """Where an online RL run's completions come from: `workers` Ray actors of their own, each
    holding the whole policy, refreshed with the trained weights after every optimizer step."""

    workers: int = Field(default=1, ge=1, description="Rollout actors; a round's prompts are spread over them "
                         "(what a completion is does not depend on how many there are).")
    engine: str = Field(
        default="transformers",
        description="`transformers`: sampling with a KV cache through the policy (transformers' models, on CPU or "
        "a GPU); `replay`: recorded completions read from `rollout.replay` instead (debugging, offline RL, "
        "equality tests); or `package.module:Class`, an engine of your own (see `rayzero/rollout/engines.py`).",
    )
    slots: int = Field(
        default=0, ge=0,
        description="Completions each rollout actor samples at once as a continuous batch: a finished completion's "
        "row is given the next one at once, so a long completion holds up one row, not its group (a transformers "
        "causal LM's KV cache). 0: one group of num_generations completions at a time.",
    )
    partial: Literal["finish", "restart", "continue"] = Field(
        default="finish",
        description="With rollout.slots and rollout.max_lag >= 1, what a continuous batch does with the completions "
        "still sampling once its round has nothing left to start: `finish`: they finish on the weights they began "
        "with, the free rows left idle meanwhile; `restart`: they are handed on to the actor's next round, whose "
        "newer weights sample them again from their start; `continue`: they are handed on and continued on the "
        "newer weights from where they were (each completion's `spans` of tokens per weight version recorded). "
        "The round they belong to is trained once they end, in the next round's batch, ahead of its own.",
    )
    replay: str = Field(
        default="",
        description="With rollout.engine=replay: JSON lines of {round, prompt, prompt_ids (optional), index, "
        "completion_ids, logprobs (optional: the sampler's, for rollout.is_correction)}; a round's prompts and "
        "their order are the file's.",
    )
    max_lag: int = Field(
        default=0, ge=0,
        description="Generation overlapped with training: generation round r is sampled from the weights of round "
        "r - max_lag (never older), so the rollout actors generate the next rounds while the ranks train. 0: each "
        "round from the weights just trained (synchronous).",
    )
    is_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        default="none",
        description="Importance sampling of the trainer's log-probabilities over the sampler's (stale weights, "
        "another engine), TRL's modes: per token or per sequence, truncated at is_clip_max/is_clip_min or masked "
        "outside them; `none`: no correction (the mismatch is still measured).",
    )
    is_clip_max: float | None = Field(default=3.0, gt=0, description="The importance ratio's upper bound C_max.")
    is_clip_min: float | None = Field(default=None, ge=0, description="The importance ratio's lower bound C_min.")
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO's dynamic sampling: a prompt whose completions' rewards are all equal is dropped and the "
        "next prompt drawn in its place, until the round is full or max_extra_prompts more were drawn.",
    )
    max_extra_prompts: int = Field(default=64, ge=0, description="With dynamic_sampling: the most prompts drawn "
                                   "beyond a round's own; a round still short trains on the groups it has, in "
                                   "fewer micro-batches (0: drop all-equal groups, draw none in their place).")
    cpus_per_worker: float = Field(default=1.0, gt=0, description="CPUs each rollout actor's placement bundle "
                                   "reserves.")
    gpus_per_worker: float = Field(default=0.0, ge=0, description="GPUs each rollout actor's bundle reserves "
                                   "(0: it generates on CPU).")

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v in ("vllm", "sglang"):
            raise ValueError(f"{v}: no engine of rayzero's samples through {v} yet (writing and testing one needs a "
                             "GPU); use transformers, or your own engine that calls it (package.module:Class)")
        if v not in ("transformers", "replay") and ":" not in v:
            raise ValueError(f"expected transformers, replay or package.module:Class (an engine of your own), got {v!r}")
        return v
