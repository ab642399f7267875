"""Online RL (`train.objective=grpo`): GRPO and its kin on the objective seam, as TRL's
`GRPOTrainer` trains them (`grpo_loss.py` holds the arithmetic).

A step's micro-batches are rollouts, made on the driver side (`cluster/rollouts.py`): each row a
prompt and one of its completions, its targets IGNORE_INDEX except on the completion's tokens,
its advantage a row field. On a rank this objective

    - takes the policy's log-probabilities of the completion tokens at the sampling temperature
      (TRL's `logits / temperature`), from the step's one forward;
    - with `grpo.num_iterations` > 1, keeps those of a generation round's first step as the
      round's old log-probabilities (the ratio's denominator at its later steps), as TRL keeps
      the ones it computes at generation time; at a round's first step the ratio is 1;
    - with `grpo.beta` > 0, asks its reference (a frozen copy, or the base with the adapters
      off) for the same log-probabilities, at the same temperature, in the same forward pass;
    - sums the clipped-ratio loss and the step's divisor (`loss_type`) over the whole step, so
      the gradient does not depend on the layout or the micro-batch split.

The driver's side (rewards, advantages, the completions' lengths) reports its own metrics; the
ones here (kl, the clip ratios, entropy) are means over the step's completion tokens.
"""

from __future__ import annotations

import torch

from rayzero.objectives.base import Metric, Objective, Output, SummedLoss
from rayzero.objectives.config import GRPOConfig
from rayzero.objectives.dpo import disable_dropout
from rayzero.objectives.grpo_loss import RAW_RATIO, ImportanceSampling, PolicyLoss, PolicyObjective
from rayzero.objectives.registry import reference_record

# The rank side's metrics, TRL's names: means over the step's completion tokens.
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# The sampler against the trainer, where the rollouts carry the sampler's log-probabilities (TRL's
# names, and the KL between the two): means over the completion tokens, the ratio's over what it
# weighs (tokens, or rows for a sequence-level ratio), and maxima
SAMPLING_METRICS = (Metric("sampling/sampling_logp_difference/mean", "mean", over="completion_tokens"),
                    Metric("sampling/sampling_logp_difference/max", "max"),
                    Metric("sampling/kl", "mean", over="completion_tokens"),
                    Metric("sampling/importance_sampling_ratio/mean", "mean", over="is_count"),
                    Metric("sampling/importance_sampling_ratio/max", "max"), Metric("is_count", "sum", shown=False))


class GRPO(Objective):
    """`train.objective=grpo`: the clipped-ratio loss over rollouts of the current policy, the
    rewards of the user's functions turned into advantages within each prompt's group."""

    data_kinds = ("prompts",)
    samples = True  # its rows are the policy's own completions: the driver runs the rollouts
    summary = "rl"
    fine_tuning_lr = (1e-6, 1e-5)  # TRL's GRPOConfig (learning_rate 1e-6); about ten times that with LoRA
    resume_hint = "to train it further with GRPO, export it (train.save_final) and start from it with model.path"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.options: GRPOConfig = cfg.grpo
        g = self.options
        self.policy = PolicyLoss(loss_type=g.loss_type, epsilon=g.epsilon, epsilon_high=g.epsilon_high, beta=g.beta,
                                 bias_corrected_kl=g.use_bias_correction_kl,
                                 max_completion_length=g.max_completion_length)
        self.loss_of = PolicyObjective(self.policy, g.temperature, cfg.parallel.cp)
        r = cfg.rollout
        self.sampling = ImportanceSampling(r.is_correction, r.is_clip_max, r.is_clip_min)

    @property
    def metrics(self) -> tuple[Metric, ...]:
        names = TOKEN_METRICS if self.options.beta else TOKEN_METRICS[1:]
        return (*(Metric(n, "mean", over="completion_tokens") for n in names),
                Metric("completion_tokens", "sum", shown=False), *SAMPLING_METRICS)

    @property
    def reference(self) -> str:
        """None with beta 0 (TRL loads no reference then); else the base with the adapters off
        (LoRA) or a frozen copy of the starting weights."""
        if not self.options.beta:
            return "none"
        return "adapters_off" if self.cfg.model.lora is not None else "frozen_copy"

    def count(self, batch) -> torch.Tensor:
        return self.loss_of.count(batch)

    def loss(self, out: Output, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total, sums = self.loss_of.loss(out, batch)
        sums["entropy"] = (out.entropy(self.options.temperature) * batch.loss_mask).sum()  # the sampler's
        sampler = batch.token_fields.get("sampler_logps")
        if sampler is not None:  # how far the sampler is from the trainer (at the round's first pass)
            old = batch.token_fields.get("old_logps")
            old = out.tempered_logps(self.options.temperature).detach() if old is None else old
            ratio = batch.token_fields.get("is_ratio")
            if ratio is None:  # no correction: the ratio it would apply, uncut, to show the mismatch
                ratio = RAW_RATIO.weights(old, sampler, batch.loss_mask)
            sums.update(self.sampling.metric_sums(old, sampler, ratio, batch.loss_mask))
        return total, sums

    def record(self, model: dict | None) -> dict:
        """What a resume must match: the options that change what a step computes."""
        g = self.options
        checked = {k: getattr(g, k) for k in ("num_generations", "num_iterations", "loss_type", "beta", "epsilon",
                                              "epsilon_high", "scale_rewards", "advantage_estimator", "temperature",
                                              "max_completion_length", "mask_truncated_completions")}
        ref = reference_record(self.reference, model) if self.reference != "none" else None
        return {"name": self.name, "reference": ref, "checked": checked}

    def plan(self, params_per_rank: int | None, frozen_bytes_per_param: float, param_dtype: str) -> dict:
        base = super().plan(params_per_rank, frozen_bytes_per_param, param_dtype)
        g = self.options
        line = (f"objective grpo: loss_type {g.loss_type}, beta {g.beta:g}, epsilon {g.epsilon:g}/{g.high:g}, "
                f"num_iterations {g.num_iterations}, advantages {g.advantage_estimator} scaled by {g.scale_rewards}; "
                + base["line"].split("; ", 1)[1])
        return {**base, "line": line}

    def rollout_plan(self, params: int | None, trainable: int | None) -> dict:
        """The rollout actors, what each holds, a round's prompts and completions, a sync's size."""
        cfg, g, r = self.cfg, self.options, self.cfg.rollout
        prompts = cfg.train.global_batch_size // g.num_generations
        mib = (lambda n: f"{n * 4 / 2**20:,.1f} MiB") if params else (lambda n: "?")
        engine = (f"sampling with {'transformers' if r.engine == 'transformers' else r.engine} (temperature "
                  f"{g.temperature:g}, top_p {g.top_p:g}, top_k {g.top_k}"
                  + (f"; a continuous batch of {r.slots} rows" if r.slots else "; a group at a time")
                  + {"finish": "", "restart": ", its unfinished completions restarted in the next round's batch",
                     "continue": ", its unfinished completions continued in the next round's batch"}[r.partial] + ")")
        adapters = cfg.model.lora is not None
        shape = (f"{prompts} prompts x {g.num_generations} completions = {cfg.train.global_batch_size} per round, up to "
                 f"{g.max_completion_length} tokens each, a round every {g.num_iterations} step"
                 f"{'s' if g.num_iterations != 1 else ''}")
        if r.engine == "replay":
            line = f"rollouts: replaying {r.replay} on the driver (no rollout actor, no weight sync); {shape}"
            return {"workers": 0, "prompts_per_round": prompts, "completions_per_round": cfg.train.global_batch_size,
                    "sync_bytes": 0, "line": line}
        ahead = (f"; generating {r.max_lag} round{'s' if r.max_lag != 1 else ''} ahead of training (each actor "
                 f"stages up to {r.max_lag} more weight version{'s' if r.max_lag != 1 else ''})" if r.max_lag else "")
        line = (f"rollouts: {r.workers} actor{'s' if r.workers != 1 else ''} ({r.cpus_per_worker:g} CPU"
                + (f", {r.gpus_per_worker:g} GPU" if r.gpus_per_worker else "") + " each), "
                f"each the whole policy in fp32 ({mib(params or 0)}), {engine}; {shape}; weight sync before each round: "
                + (f"the adapters, {mib(trainable or 0)} (the base once, at the start)" if adapters
                   else f"{mib(params or 0)}") + ahead
                + (f"; importance sampling {r.is_correction}" if r.is_correction != "none" else "")
                + ("; dynamic sampling" if r.dynamic_sampling else ""))
        return {"workers": r.workers, "prompts_per_round": prompts, "completions_per_round": cfg.train.global_batch_size,
                "sync_bytes": 4 * ((trainable if adapters else params) or 0), "line": line}

    def rank_side(self, ctx) -> "PolicyStep":
        if self.options.disable_dropout:
            disable_dropout(ctx.model)
        return PolicyStep(self, ctx)


class PolicyStep(SummedLoss):
    """GRPO on a rank: the reference's log-probabilities at the sampling temperature, and a
    round's first log-probabilities kept for its later steps (`grpo.num_iterations` > 1)."""

    def __init__(self, objective: GRPO, ctx):
        super().__init__(objective, ctx)
        self.ref_temperature = objective.options.temperature
        self.iterations = objective.options.num_iterations
        self._old: dict[int, torch.Tensor] = {}  # micro-batch index -> the round's first log-probabilities
        self._is: dict[int, torch.Tensor] = {}  # micro-batch index -> the round's importance ratio
        self.sampling = objective.sampling
        self._first = True
        self._index = 0

    def begin(self, micro, rows, step: int, whole) -> None:
        self._first = step % self.iterations == 0
        losses_here = self.ctx.pipe is None or self.ctx.pipe.stages.last  # a pipeline's loss is its last stage's
        if self._first:
            self._old, self._is = {}, {}
        elif losses_here and len(self._old) != len(micro):
            raise RuntimeError(f"step {step} is inside a generation round whose first step this rank did not run "
                               f"(grpo.num_iterations={self.iterations}): its old log-probabilities are gone")
        super().begin(micro, rows, step, whole)

    def loss(self, model, batch, check: bool, index: int):
        self._index = index
        if not self._first:
            batch = batch.with_fields(tokens={"old_logps": self._old[index],
                                              **({"is_ratio": self._is[index]} if index in self._is else {})})
        return super().loss(model, batch, check, index)

    def _loss(self, out: Output, batch):
        if self._first:
            old = out.tempered_logps(self.ref_temperature).detach()
            if self.iterations > 1:
                self._old[self._index] = old
            sampler = batch.token_fields.get("sampler_logps")
            if sampler is not None and self.sampling.mode != "none":  # the trainer's at generation over the sampler's
                whole = self.ctx.cp.whole if self.ctx.cp is not None else None
                self._is[self._index] = self.sampling.weights(old, sampler, batch.loss_mask, whole)
                batch = batch.with_fields(tokens={"is_ratio": self._is[self._index]})
        return super()._loss(out, batch)
