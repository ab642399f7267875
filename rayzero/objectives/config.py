"""The objectives a run can train for, as the config and the CLI see them, without torch: each
built-in one by name (`OBJECTIVES`: where its code is, and the checks its options take), its
options' section (`DPOConfig`), a user's own by `package.module:Class`. The objectives' code is in
their own files (`next_token.py`, `dpo.py`), imported when a run makes one (`registry.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import Field, field_validator

from rayzero._frozen import Frozen


class DPOConfig(Frozen):
    """Preference tuning (`train.objective=dpo`), in the terms of TRL's `DPOConfig`: the loss
    over pairs of completions (chosen, rejected) to one prompt, and its reference model."""

    beta: float = Field(
        default=0.1, gt=0,
        description="How far the policy may move from the reference: the rewards are beta x (log-prob of the "
        "policy - log-prob of the reference); for `ipo`, the regularization tau; for `orpo`, the weight of the "
        "odds-ratio term (TRL's ORPO beta, lambda in the paper).",
    )
    loss: Literal["sigmoid", "ipo", "hinge", "robust", "orpo"] = Field(
        default="sigmoid",
        description="`sigmoid` = DPO (-log sigmoid(beta x margin)); `ipo` = IPO's squared loss on the margin per "
        "completion token; `hinge` = SLiC's relu(1 - beta x margin); `robust` = robust DPO under flipped labels "
        "(`label_smoothing` the flip rate); `orpo` = ORPO, reference-free: the chosen completions' NLL plus beta x "
        "the odds-ratio loss, with no reference model.",
    )
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5,
        description="The share of preference labels taken to be wrong, for `robust` (as TRL: the other losses "
        "take none, and a value for them is refused rather than ignored).",
    )
    disable_dropout: bool = Field(
        default=True,
        description="No dropout in the policy: its dropout modules set to p=0, as TRL's `disable_dropout` (its "
        "default) does, and its attention's dropout rate too; the reference always runs in eval mode.",
    )
    precompute_ref: bool = Field(
        default=False,
        description="Compute the reference log-probabilities of every training and validation pair in one pass "
        "before training, then drop the reference model (TRL's `precompute_ref_log_probs`); not with `orpo`, "
        "which has no reference.",
    )

    @property
    def uses_reference(self) -> bool:
        return self.loss != "orpo"


def check_dpo(cfg) -> None:
    """What preference tuning refuses, before anything starts."""
    t, d = cfg.train, cfg.dpo
    if t.micro_batch_size % 2:
        raise ValueError(f"train.micro_batch_size: {t.micro_batch_size} would split a preference pair (chosen and "
                         "rejected are two sequences of one micro-batch); make it even")
    if d.label_smoothing and d.loss != "robust":
        raise ValueError(f"dpo.label_smoothing: {d.label_smoothing:g} would do nothing to dpo.loss="
                         f"{d.loss} (as in TRL, only robust DPO takes it); use dpo.loss=robust, or leave it 0")
    if d.precompute_ref and not d.uses_reference:
        raise ValueError(f"dpo.precompute_ref: dpo.loss={d.loss} has no reference model to precompute")


def _listed(v):
    """A list from the command line's comma-separated text (`a.py:f,b.py:g`), or as given."""
    if isinstance(v, str):
        return [s.strip() for s in v.split(",") if s.strip()]
    return v


class GRPOConfig(Frozen):
    """Online RL (`train.objective=grpo`), in the terms of TRL's `GRPOConfig`: each prompt's
    `num_generations` completions sampled from the current policy by the rollout actors
    (`rollout.`), scored by the reward functions, each advantage its reward against its group's,
    and the clipped-ratio loss on them."""

    num_generations: int = Field(
        default=8, ge=1,
        description="Completions sampled per prompt (a group); `train.global_batch_size` counts completions, so "
        "each step trains on global_batch_size / num_generations prompts.",
    )
    max_completion_length: int = Field(default=256, ge=1, description="The most tokens a completion may have.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature; the loss reads the policy's "
                               "log-probabilities at the same temperature, as TRL's.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling's share of probability (1: off).")
    top_k: int = Field(default=0, ge=0, description="Sampling from the k likeliest tokens (0: off).")
    beta: float = Field(
        default=0.0, ge=0,
        description="The KL penalty's weight against the reference model (TRL's k3 estimator); 0 (TRL's default) "
        "builds no reference. The reference of a LoRA run is its base with the adapters off, of a full fine-tune "
        "a frozen copy of the starting weights.",
    )
    use_bias_correction_kl: bool = Field(
        default=True, description="Multiply the KL term by the importance ratio (TRL's default): the unbiased "
        "reverse-KL gradient.")
    num_iterations: int = Field(
        default=1, ge=1,
        description="Optimizer steps on each generation round (mu): the round's completions are trained on this "
        "many times, the ratio against the log-probabilities of the round's first pass.",
    )
    epsilon: float = Field(default=0.2, gt=0, lt=1, description="The ratio's clip: 1 - epsilon below.")
    epsilon_high: float | None = Field(
        default=None, gt=0,
        description="The ratio's clip above, 1 + epsilon_high (DAPO's clip-higher); unset: epsilon.")
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = Field(
        default="dapo",
        description="How the per-token losses are summed and divided, every divisor over the whole step: `dapo` "
        "(TRL's default) and `bnpo` over the step's completion tokens; `grpo` each completion's mean over its "
        "tokens, averaged over completions; `dr_grpo` over completions x max_completion_length.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group", description="Advantages divided by the std of the group's rewards, of the batch's, or "
        "not at all (Dr. GRPO).")
    advantage_estimator: Literal["grpo", "rloo"] = Field(
        default="grpo", description="The baseline a reward is measured against: its group's mean (`grpo`) or the "
        "mean of the group's other completions (`rloo`, RLOO's leave-one-out).")
    mask_truncated_completions: bool = Field(
        default=False, description="Completions cut at max_completion_length without an end-of-sequence take no "
        "part in the loss (DAPO).")
    reward_funcs: list[str] = Field(
        default_factory=list,
        description="The reward functions, TRL's signature: `accuracy` (math-verify) and `format` (a <think> block "
        "then the answer) are built in, else `path/to/file.py:fn` or `package.module:fn`; on the command line "
        "comma-separated. From Python, `Trainer(config, rewards=[fn, ...])` adds callables.",
    )
    reward_weights: list[float] | None = Field(
        default=None, description="One weight per reward function (1 each if unset); the reward is their "
        "weighted sum.")
    disable_dropout: bool = Field(default=False, description="Dropout off in the policy (TRL's default: on).")

    _split = field_validator("reward_funcs", "reward_weights", mode="before")(classmethod(lambda cls, v: _listed(v)))

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def check_grpo(cfg) -> None:
    """What online RL refuses, before anything starts."""
    t, g, r = cfg.train, cfg.grpo, cfg.rollout
    if g.num_generations < 2:
        raise ValueError("grpo.num_generations: 1 leaves no group to measure a completion's reward against; "
                         "use at least 2")
    if t.global_batch_size % g.num_generations:
        n, b = g.num_generations, t.global_batch_size
        down, up = b // n * n, -(-b // n) * n
        raise ValueError(f"train.global_batch_size: {b} completions is not a whole number of groups of "
                         f"grpo.num_generations={n}; the nearest that are: "
                         + " or ".join(str(x) for x in dict.fromkeys((down, up)) if x > 0))
    if g.epsilon_high is not None and g.epsilon_high < g.epsilon:
        raise ValueError(f"grpo.epsilon_high: {g.epsilon_high:g} is below grpo.epsilon ({g.epsilon:g}); "
                         "clip-higher takes a larger upper clip")
    if g.reward_weights is not None and g.reward_funcs and len(g.reward_weights) != len(g.reward_funcs):
        raise ValueError(f"grpo.reward_weights: {len(g.reward_weights)} weights for {len(g.reward_funcs)} reward "
                         "functions (one each)")
    if g.max_completion_length >= t.seq_len:
        raise ValueError(f"grpo.max_completion_length: {g.max_completion_length} leaves no room for a prompt in "
                         f"train.seq_len={t.seq_len} (a row is the prompt and its completion)")
    if cfg.data.val_path or cfg.data.val_fraction:
        raise ValueError("data.val_fraction: validation of an online RL run is not built yet (its reward is "
                         "in every step's metrics); leave data.val_fraction and data.val_path unset")
    if r.engine == "replay" and not r.replay:
        raise ValueError("rollout.replay: rollout.engine=replay reads recorded completions from a JSON lines file; "
                         "give its path")
    if r.dynamic_sampling and r.engine == "replay":
        raise ValueError("rollout.dynamic_sampling: a replayed round's prompts are the file's; dynamic sampling "
                         "draws prompts of its own (leave it off with rollout.engine=replay)")
    if r.slots and r.engine == "replay":
        raise ValueError("rollout.slots: rollout.engine=replay samples nothing (its completions are the file's); "
                         "leave rollout.slots at 0")
    if r.slots and not cfg.model.samples_with_cache():
        raise ValueError(f"rollout.slots: a continuous batch needs a transformers causal LM's KV cache; "
                         f"model.kind={cfg.model.kind} samples a group at a time (leave rollout.slots at 0)")
    if r.partial != "finish" and not r.slots:
        raise ValueError(f"rollout.partial: {r.partial} hands a continuous batch's unfinished completions on to the "
                         "next round's; set rollout.slots (rows of the batch) too, or leave rollout.partial=finish")
    if r.partial != "finish" and not r.max_lag:
        raise ValueError(f"rollout.partial: {r.partial} needs rollout.max_lag >= 1: at max_lag 0 the next round's "
                         "weights come only once this round is trained, so nothing could finish its completions")
    if r.is_clip_min is not None and r.is_clip_max is not None and r.is_clip_min > r.is_clip_max:
        raise ValueError(f"rollout.is_clip_min: {r.is_clip_min:g} is above rollout.is_clip_max ({r.is_clip_max:g})")
    if r.replay and r.engine != "replay":
        raise ValueError(f"rollout.replay: read only by rollout.engine=replay (this run has rollout.engine={r.engine})")
    every = cfg.checkpoint.every_steps
    if cfg.checkpoint.dir and every and every % g.num_iterations:
        raise ValueError(f"checkpoint.every_steps: {every} would commit inside a generation round of "
                         f"grpo.num_iterations={g.num_iterations} steps (the round's first log-probabilities are "
                         f"not kept); use a multiple of {g.num_iterations}")


@dataclass(frozen=True)
class Registered:
    """A built-in objective: its class (`module:Class`), and the checks its options take
    before anything starts (no torch)."""

    path: str
    check: Callable | None = None
    summary: str = ""  # one line for `train.objective`'s description


# The built-in objectives, by `train.objective`'s value: one line each.
OBJECTIVES = {
    "lm": Registered("rayzero.objectives.next_token:NextToken",
                     summary="next-token prediction on text or instruction data"),
    "dpo": Registered("rayzero.objectives.dpo:DPO", check_dpo,
                      summary="preference tuning on pairs (data prepared with `--preferences`; the loss in `dpo`); "
                              "batch sizes count sequences: a pair is two, its chosen and rejected always in one "
                              "micro-batch"),
    "grpo": Registered("rayzero.objectives.grpo:GRPO", check_grpo,
                       summary="online RL on prompts (data prepared with `--prompts`): completions sampled by the "
                               "rollout actors, scored by `grpo.reward_funcs`, the clipped-ratio loss in `grpo`; "
                               "batch sizes count completions"),
}


def is_path(name: str) -> bool:
    """Whether `train.objective` names a user's class (`package.module:Class`) rather than a built-in."""
    return ":" in name


def check_name(name: str) -> str:
    """`train.objective`'s value, refused unless a built-in's name or `package.module:Class`."""
    if name in OBJECTIVES:
        return name
    module, sep, attr = name.partition(":")
    if sep and module and attr:
        return name
    raise ValueError(f"expected {', '.join(OBJECTIVES)} or package.module:Class (an Objective of your own)")


def check_options(cfg) -> None:
    """The built-in objective's checks of the config (a user's own runs `Objective.check` when
    it is imported, before the cluster starts)."""
    entry = OBJECTIVES.get(cfg.train.objective)
    if entry is not None and cfg.train.objective_kwargs:
        raise ValueError(f"train.objective_kwargs: for an objective of your own (train.objective=package.module:Class); "
                         f"train.objective={cfg.train.objective} takes none")
    if entry is not None and entry.check is not None:
        entry.check(cfg)
