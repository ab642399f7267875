"""The learning-rate schedule, computed by the controller and sent to ranks with each plan, and
which steps end with an evaluation.

Every schedule warms up linearly to `lr` over `warmup_steps`, then

    cosine    decays along half a cosine to `min_lr` at the last step
    linear    decays in a straight line to `min_lr` at the last step
    constant  stays at `lr`
    wsd       (warmup-stable-decay) stays at `lr`, then decays linearly to `min_lr` over the
              last `decay_fraction` of the steps

The last step is `total - 1`, where `total` is the schedule's length: `train.steps`, or on a
resume with more steps, the length the run started with (`optim.schedule_total=original`),
past which the learning rate stays at `min_lr`.
"""

import math

from rayzero.sharding.config import OptimConfig


def evaluates(cfg, k: int, checkpoint_due: bool = False) -> bool:
    """Whether step `k` ends with an evaluation (given validation data): every
    `train.eval_every` steps, after the last, and with `checkpoint.keep_best` at every
    checkpoint (so that each one has a loss to be judged by)."""
    every = cfg.train.eval_every
    if k + 1 == cfg.train.steps or (every > 0 and (k + 1) % every == 0):
        return True
    return bool(cfg.checkpoint.keep_best) and checkpoint_due


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The learning rate of iteration `step` (0-based) of a schedule `total_steps` long."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * (step + 1) / w
    if cfg.schedule == "constant":
        return cfg.lr
    last = total_steps - 1
    if step >= last and last >= w:
        return cfg.final_lr
    peak = max(w - 1, 0)
    if cfg.schedule == "wsd":
        start = max(peak, last - decay_steps(total_steps, cfg))  # the decay's first step is still at lr
        progress = 0.0 if step <= start else (step - start) / max(1, last - start)
        return cfg.lr + (cfg.final_lr - cfg.lr) * progress
    progress = min(1.0, (step - peak) / max(1, last - peak))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.final_lr - cfg.lr) * progress
    return cfg.final_lr + 0.5 * (cfg.lr - cfg.final_lr) * (1 + math.cos(math.pi * progress))


def decay_steps(total_steps: int, cfg: OptimConfig) -> int:
    """wsd: the steps the final decay takes (at least one)."""
    return max(1, round(cfg.decay_fraction * total_steps))


def describe(total_steps: int, cfg: OptimConfig) -> str:
    """The schedule in words, for the dry-run plan."""
    warm = f"warmup {cfg.warmup_steps} steps to {cfg.lr:g}, " if cfg.warmup_steps else f"{cfg.lr:g}, "
    end = f"{cfg.final_lr:g} at step {total_steps - 1}"
    if cfg.schedule == "constant":
        return f"lr constant: {warm}then {cfg.lr:g} to the end"
    if cfg.schedule == "wsd":
        n = decay_steps(total_steps, cfg)
        return (f"lr wsd: {warm}stable to step {total_steps - 1 - n}, then linear decay over the last {n} steps "
                f"({cfg.decay_fraction:g} of {total_steps}) to {end}")
    return f"lr {cfg.schedule}: {warm}{cfg.schedule} decay to {end}"


def schedule_length(steps: int, cfg: OptimConfig, manifest: dict | None) -> int:
    """How long the schedule of a run resumed from `manifest` is: the length it started with
    (`schedule_total=original`), or `steps` (`new`, or a run started afresh)."""
    if manifest is None or cfg.schedule_total == "new":
        return steps
    return (manifest.get("schedule") or {}).get("total_steps", steps)
