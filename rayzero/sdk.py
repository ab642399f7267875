"""Training from Python (a notebook, a script): the same run as `rayzero train`.

    from rayzero import Trainer, TrainConfig

    config = TrainConfig.from_yaml("job.yaml", ["train.steps=200"])   # or TrainConfig(train={...})
    result = Trainer(config).fit()
    result.history          # one row per step: loss, tokens/s, per-phase times, ...
    result.plot()
    result.checkpoint, result.mlflow_run_id

`fit()` starts a local Ray unless one is running or `cluster.address` names a cluster, and
shuts down only what it started, so it can run again in the same kernel. As the command line
does, it says each start-up stage in one line as it begins (on stderr, under the cell). An interrupt (the
notebook's stop button) ends the run cleanly: the rank actors are gone and the last committed
checkpoint stays as it was; fitting the same config again resumes from it.

With `cluster.keep_ranks=true` a run that ends well keeps its rank processes (and online RL's
rollout actors) for the next `fit()` placed alike, which then starts in a second or two instead
of starting processes and importing torch and the model's code (4-12 s on a laptop); they hold
their CPUs or GPUs while idle, until `release_ranks()`, a run placed otherwise, or the kernel's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from rayzero.cluster.history import PHASES
from rayzero.config import ConfigError, RootConfig, explain, load_config


class TrainConfig(RootConfig):
    """A whole run's configuration, built in Python or read from YAML:

        TrainConfig(model={"preset": "small"}, train={"steps": 200})
        TrainConfig.from_yaml("job.yaml", ["train.steps=50"]).override("cluster.num_workers=4")

    A mistake is a ConfigError worded as the command line words it."""

    def __init__(self, **sections: Any):
        try:
            super().__init__(**sections)
        except ValidationError as e:
            raise ConfigError(explain(e)) from None



class Trainer:
    """Runs a configuration, as `rayzero train` does, from Python: `Trainer(config).fit()`."""

    def __init__(self, config: RootConfig | str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                 *, model: Callable[..., Any] | None = None, objective: type | None = None,
                 rewards: list[Callable] | tuple = (), progress: bool = True):
        """`config`: a TrainConfig, or the path of a YAML file (None: every default);
        `overrides`: `key=value` items applied on top, as on the command line; `model`: any
        callable returning an `nn.Module` (a class, a function, one defined in a notebook
        cell), called with `model.kwargs` on every rank: the run trains it
        (`model.kind=module`); `objective`: a subclass of `rayzero.objectives.Objective` (one
        defined in a notebook cell too): what the run optimises (`train.objective`); `rewards`:
        reward functions for online RL (`train.objective=grpo`), TRL's signature, after those
        `grpo.reward_funcs` names."""
        if model is not None:
            if not callable(model):
                raise ConfigError(f"model: expected a callable that returns an nn.Module, got {type(model).__name__}")
            from rayzero.models.module import describe

            overrides = ["model.kind=module", f"model.factory={describe(model)}", *overrides]
        if objective is not None:
            from rayzero.models.module import describe

            overrides = [f"train.objective={describe(objective)}", *overrides]
        if config is None or isinstance(config, (str, Path)):
            config = load_config(config, overrides)
        elif overrides:
            config = config.override(*overrides)
        self.config = config
        self.model = model
        self.objective = objective
        self.rewards = tuple(rewards)
        self.progress = progress

    def fit(self) -> "Result":
        """Train: start a local Ray (or join `cluster.address`), run to `train.steps`, and shut
        down only what it started, so it runs again in the same kernel. Fitting the same config
        again resumes from its last commit and goes on in the same run directory, MLflow run and
        history. An interrupt (Ctrl-C, a notebook's stop) ends the run after the iteration in
        flight, its last commit intact. A mistake in the config, the data or the model raises a
        `ConfigError` before Ray starts; a run that fails for good raises with its cause."""
        from rayzero.jobs.train import train_run

        summary, rows = train_run(self.config, progress=self.progress, factory=self.model, objective=self.objective,
                                  rewards=self.rewards)
        return Result(summary, rows, self.config)


@dataclass
class Result:
    """What a run did: its summary, its metrics step by step, and the way to its weights."""

    summary: dict  # what `rayzero train --summary-json` writes
    rows: list[dict]  # each step's metrics
    config: RootConfig | None = None  # the job's

    @property
    def history(self):
        """Per-step metrics as a pandas DataFrame indexed by step: loss, lr, grad_norm,
        tokens_per_s, step_ms, phase_<name>_ms, world_size, val_loss and val_perplexity (at the
        steps that evaluated, NaN elsewhere), and what else was logged; with preference tuning,
        `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`,
        `logps/chosen`, `logps/rejected` (TRL's names) and their `val_` twins."""
        import pandas as pd

        frame = pd.DataFrame(self.rows)
        return frame.set_index("step") if not frame.empty else frame

    @property
    def metrics(self) -> dict[str, Any]:
        """The final figures: losses, throughput, steps, restarts; with preference tuning, the
        last step's and the last validation's rewards and log-probabilities (TRL's names)."""
        s = self.summary
        keys = ("final_loss", "first_loss", "final_val_loss", "best_val_loss", "steps", "start_step", "total_steps",
                "tokens_per_s", "tokens_per_s_per_rank", "mfu", "step_ms", "world_size", "restarts", "skipped_steps",
                "stopped_early")
        prefs = {**(s.get("final_preferences") or {}), **(s.get("final_val_preferences") or {})}
        return {**{k: s.get(k) for k in keys}, **prefs}

    @property
    def memory(self) -> dict[str, Any]:
        """What a rank held at its most: model state per parameter by category
        (`bytes_per_param`), the transient peak, and the peak of a micro-batch's saved
        activations (`activations_peak_bytes`)."""
        return self.summary.get("memory", {})

    @property
    def checkpoint(self) -> str | None:
        """The last committed checkpoint's URI."""
        return self.summary["checkpoint"]

    @property
    def best_checkpoint(self) -> str | None:
        """With `checkpoint.keep_best=val_loss`: the commit with the lowest validation loss."""
        return self.summary.get("best_checkpoint")

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run the metrics went to (None with `tracking.enabled=false`)."""
        return self.summary["mlflow_run_id"] or None

    @property
    def final_weights(self) -> str | None:
        """Where `train.save_final` wrote the final weights (None without it)."""
        return self.summary["final_weights"]

    def generate(self, prompt: str | None = None, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0, tokenizer: str | None = None, *, messages: list[dict] | None = None,
                 system: str | None = None, chat: bool | None = None) -> str:
        """The trained model's continuation of `prompt` (greedy at temperature 0), on this
        machine, from the final weights (`train.save_final`), else the last checkpoint. With a
        chat template (`chat=None`: when the tokenizer has one), `prompt` is the user's message
        after `system`, or `messages=[{"role": ..., "content": ...}, ...]` the conversation,
        and the answer ends at the template's end-of-turn token; `chat=False`: raw text."""
        from rayzero.jobs.generate import load_generator

        weights = self.final_weights or self.checkpoint
        if weights is None:
            raise ConfigError("nothing to generate with: train with train.save_final or checkpoint.dir set")
        key = (weights, tokenizer)
        if getattr(self, "_generator", (None,))[0] != key:
            self._generator = (key, load_generator(weights, self.config, tokenizer))
        return self._generator[1](prompt, max_new_tokens, temperature, top_k, seed, messages=messages, system=system,
                                  chat=chat)

    def plot(self, path: str | Path | None = None):
        """Loss, tokens/s and per-phase time against the step, as one matplotlib figure
        (in Jupyter, drawn under the cell); saved to `path` too if given."""
        import matplotlib

        h = self.history
        size = {"figsize": (15, 4), "layout": "constrained"}
        if "inline" in matplotlib.get_backend():  # Jupyter: shown under the cell, then closed
            import matplotlib.pyplot as plt

            fig = plt.figure(**size)
        else:  # scripts: no pyplot, so no global list of figures and no GUI backend
            from matplotlib.figure import Figure

            fig = Figure(**size)
        prefs = not h.empty and "rewards/margins" in h  # preference tuning: its reward margin too
        rl = not h.empty and "reward" in h  # online RL: its reward too
        axes = fig.subplots(1, 4 if prefs or rl else 3)
        loss, speed, phases = axes[:3]
        if rl:
            reward = axes[3]
            got = h["reward"].dropna()
            reward.plot(got.index, got, label="mean")
            if "reward_std" in h:
                std = h["reward_std"].reindex(got.index)
                reward.fill_between(got.index, got - std, got + std, alpha=0.2, label="± std")
            reward.legend(loc="upper left", fontsize="small")
            reward.set(title="reward", xlabel="step")
        if prefs:
            margin = axes[3]
            margin.plot(h.index, h["rewards/margins"], label="train")
            if "val_rewards/margins" in h:
                val = h["val_rewards/margins"].dropna()
                margin.plot(val.index, val, "o-", label="validation")
                margin.legend(loc="upper left", fontsize="small")
            margin.set(title="reward margin (chosen - rejected)", xlabel="step")
        if not h.empty:
            loss.plot(h.index, h["loss"], label="train")
            if "val_loss" in h:
                val = h["val_loss"].dropna()
                loss.plot(val.index, val, "o-", label="validation")
                loss.legend(loc="upper right", fontsize="small")
            speed.plot(h.index, h["tokens_per_s"])
            cols = [f"phase_{p}_ms" for p in PHASES if f"phase_{p}_ms" in h]
            phases.stackplot(h.index, *(h[c] for c in cols), labels=[c[6:-3] for c in cols])
            phases.legend(loc="upper right", fontsize="small")
        loss.set(title="loss", xlabel="step")
        speed.set(title="tokens/s", xlabel="step")
        phases.set(title="time per phase (ms, slowest rank)", xlabel="step")
        if path is not None:
            fig.savefig(path)
        return fig

    def __repr__(self) -> str:
        m = self.metrics
        loss = f"loss {m['first_loss']:.4f} -> {m['final_loss']:.4f}" if m["steps"] else "nothing trained"
        return (f"Result({m['steps']} steps to {m['total_steps']}, {loss}, checkpoint={self.checkpoint!r}, "
                f"mlflow_run_id={self.mlflow_run_id!r})")


def release_ranks() -> None:
    """End the rank processes a run with `cluster.keep_ranks` kept (and the Ray connection it
    left open for them), freeing their resources; nothing to do if none are kept."""
    from rayzero.cluster.worker_group import release_ranks as release

    release()
