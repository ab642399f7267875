"""The root config, composed of each component's own config, loaded from YAML + overrides.

    cfg = load_config("job.yaml", ["train.steps=50", "model.preset=small"])

Every error a user can make here surfaces as a `ConfigError` naming the key and what was
expected, before any cluster is touched.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from rayzero._frozen import Frozen
from rayzero.checkpoint.config import CheckpointConfig
from rayzero.cluster.config import ClusterConfig, FailureConfig, TrackingConfig
from rayzero.data.config import DataConfig
from rayzero.models.config import ModelConfig
from rayzero.objectives.config import OBJECTIVES, DPOConfig, GRPOConfig, check_name, check_options
from rayzero.rollout.config import RolloutConfig
from rayzero.sharding.config import MoEConfig, OptimConfig, ParallelConfig, ShardingConfig
from rayzero.sharding.mesh import AXES, Mesh, MeshError, fits


class ConfigError(ValueError):
    """A user's configuration mistake; the message names the key."""


class RunConfig(Frozen):
    """The training run: how long, how big a batch, its seed, and where its outputs go."""

    steps: int = Field(default=100, ge=1, description="Optimizer steps to train for; left unset beside `data.epochs`, "
                       "the epochs' steps (a run from pretrained weights defaults to 3 epochs).")
    global_batch_size: int = Field(
        default=16, ge=1,
        description="Sequences per optimizer step, across all ranks; must be divisible by "
        "`micro_batch_size` x the data-parallel size, `cluster.num_workers` / (`parallel.pp` x `parallel.cp` x "
        "`parallel.tp`) (the ranks of a tensor- or context-parallel group and a pipeline's stages share one part).",
    )
    micro_batch_size: int = Field(
        default=4, ge=1,
        description="Sequences per forward/backward on a rank; the rest of the global batch is gradient "
        "accumulation.",
    )
    seq_len: int = Field(default=128, ge=1, description="Tokens per training sequence (a window of packed examples holds "
                         "`seq_len` + 1). A run from pretrained weights defaults to 1,024, at most the model's positions.")
    objective: str = Field(
        default="lm",
        description="What the run optimises: "
        + "; ".join(f"`{name}` = {entry.summary}" for name, entry in OBJECTIVES.items())
        + "; or `package.module:Class`, an `Objective` of your own (see the objectives guide).",
    )
    objective_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="An objective of your own: keyword arguments for its class, after the config "
        "(`Class(cfg, **objective_kwargs)`); recorded with each checkpoint, and a resume with others is refused. "
        "The built-in objectives take their options from their own sections (`dpo.`).",
    )
    @field_validator("objective")
    @classmethod
    def _objective_name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("objective_kwargs", mode="before")
    @classmethod
    def _objective_kwargs(cls, v):
        return ModelConfig._parse(v)  # read as model.kwargs is: each text value as YAML

    seed: int = Field(
        default=0, ge=0,
        description="Seed of the initial weights and of the data order; every world size and strategy "
        "starts from the same weights.",
    )
    save_final: str = Field(
        default="",
        description="Where to write the final consolidated weights (local path or URI; `s3://` uses the "
        "`checkpoint.s3_*` settings), as `save_format` says: a safetensors file (`safetensors`), a Hugging Face "
        "model directory (`hf`) or a PEFT directory of the LoRA adapters alone (`peft`); empty = none.",
    )
    save_format: Literal["safetensors", "hf", "peft"] = Field(
        default="safetensors",
        description="`safetensors` = one file by `state_dict()` names, fp32; `hf` = a directory that "
        "`AutoModelForCausalLM.from_pretrained` loads (model.kind=hf), in the pretrained weights' dtype; with "
        "`model.lora` both hold the adapters merged into the base weights. `peft` = the adapters alone "
        "(`adapter_model.safetensors`, `adapter_config.json`) that `peft.PeftModel.from_pretrained` loads onto "
        "the base model.",
    )
    eval_every: int = Field(
        default=0, ge=0,
        description="With validation data (`data.val_path` or `data.val_fraction`): evaluate every this many "
        "steps, and after the last; 0 = after the last step only.",
    )
    eval_at_start: bool | None = Field(
        default=None,
        description="Evaluate once before the first step (logged at step -1), so the validation curve has a "
        "baseline; `null` = on when there is validation data. Not repeated on a resume.",
    )
    early_stopping_patience: int = Field(
        default=0, ge=0,
        description="End the run, cleanly and with a checkpoint, after this many evaluations in a row without "
        "the validation loss improving on its best by more than `early_stopping_min_delta`; 0 = never.",
    )
    early_stopping_min_delta: float = Field(
        default=0.0, ge=0,
        description="How much lower than the best so far a validation loss must be to count as an improvement.",
    )
    overwrite_final: bool = Field(
        default=False,
        description="Let `save_final` replace an export of another model (another source or config); the same "
        "model's export is always rewritten.",
    )
    eval_batches: int = Field(
        default=8, ge=1,
        description="Global batches of validation rows each evaluation reads (the same rows every time; fewer if "
        "the validation data holds fewer).",
    )
    compile: bool = Field(
        default=False,
        description="Compile each transformer block with `torch.compile` on the ranks (the blocks' own forward: "
        "the sharding hooks, the embedding, the head and the loss stay eager). The first step compiles (its "
        "seconds are shown as `torch compile` in the start-up line); inductor's on-disk caches spare a restart, a "
        "spare or the next run most of it. Not with `model.activation_checkpointing=selective`.",
    )
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        default="inductor",
        description="`torch.compile`'s backend with `compile`: `inductor` generates fused kernels (C++ on CPU, "
        "Triton on GPU); `aot_eager` traces forward and backward as inductor does but runs torch's own "
        "kernels (no code generated: for finding whether a model compiles, and quickly).",
    )
    compile_cache: str | None = Field(
        default=None,
        description="Where inductor keeps its on-disk caches with `compile` (compiled graphs, AOT autograd, "
        "kernels), so that a restart, a warm spare or a resumed run loads what the first step compiled instead "
        "of compiling again. Unset: the run directory's `compile_cache`. A local path on each node (a rank "
        "that cannot create it keeps inductor's default, the system's temp directory).",
    )
    output_dir: str = Field(
        default="runs",
        description="Each run gets a directory below it, named by `tracking.run_name`; a relative "
        "`checkpoint.dir` is below it too.",
    )


class RootConfig(Frozen):
    """A whole job: one section per component (in Python, `rayzero.TrainConfig`).

        RootConfig.from_yaml("job.yaml", ["train.steps=50"]).override("cluster.num_workers=4")
    """

    @classmethod
    def from_yaml(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> "RootConfig":
        """A YAML file of sections (or none: every default) with `key=value` overrides."""
        return load_config(path, overrides, cls)

    def override(self, *overrides: str) -> "RootConfig":
        """This config with `key=value` overrides applied, validated again. The keys it was given
        stay the ones it was given, these added (`is_set`): a default is still a default."""
        return build_config(apply_overrides(self.model_dump(by_alias=True, exclude_unset=True), overrides), type(self))

    def is_set(self, key: str) -> bool:
        """Whether the dotted `key` (`optim.lr`) was given, by the YAML file, an override or the
        caller, rather than left to its default."""
        node = self
        for part in key.split("."):
            if not isinstance(node, Frozen) or part not in node.model_fields_set:
                return False
            node = getattr(node, part)
        return True

    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sharding: ShardingConfig = ShardingConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: RunConfig = RunConfig()
    optim: OptimConfig = OptimConfig()
    tracking: TrackingConfig = TrackingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    failure: FailureConfig = FailureConfig()
    dpo: DPOConfig = DPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    rollout: RolloutConfig = RolloutConfig()
    moe: MoEConfig = MoEConfig()

    @model_validator(mode="after")
    def _check(self):
        try:
            self.mesh().validate(self)
        except MeshError as e:
            raise ValueError(str(e)) from None
        t = self.train
        low = self.cluster.min_workers
        if low is not None and low > self.cluster.num_workers:
            raise ValueError(
                f"cluster.min_workers: {low} exceeds cluster.num_workers ({self.cluster.num_workers})"
            )
        if low is not None and self.world_sizes() == [self.cluster.num_workers] and low < self.cluster.num_workers:
            sizes = self._set_sizes()
            multiple = " x ".join(f"{AXES[a]} ({n})" for a, n in sizes.items() if n > 1)
            raise ValueError(
                f"cluster.min_workers: no world size from {low} to {self.cluster.num_workers - 1} keeps "
                f"train.global_batch_size ({t.global_batch_size}) divisible by train.micro_batch_size "
                f"({t.micro_batch_size}) x the data-parallel size"
                + (f" and is a multiple of {multiple}, over which the world size is divided" if multiple else "")
            )
        if self.model.block_size is not None and self.model.block_size < t.seq_len:
            raise ValueError(
                f"model.block_size: {self.model.block_size} is shorter than train.seq_len ({t.seq_len})"
            )
        adapter = self.model.adapter or _adapter_dir(self.model.path)  # its base and settings come later
        if t.save_format == "hf" and not adapter and not self.model.exports_hf_dir():
            raise ValueError(f"train.save_format: hf needs model.kind=hf (this is model.kind={self.model.kind}); "
                             "use safetensors")
        if t.save_format == "peft" and self.model.lora is None and not adapter:
            raise ValueError("train.save_format: peft writes LoRA adapters, and this run has none (set model.lora, "
                             "e.g. model.lora.r=8)")
        if self.data.val_path and self.data.val_fraction:
            raise ValueError("data.val_fraction: give either it or data.val_path, not both")
        validates = bool(self.data.val_path or self.data.val_fraction)
        if t.early_stopping_patience and not validates:
            raise ValueError("train.early_stopping_patience: needs validation data (data.val_fraction or "
                             "data.val_path)")
        if self.checkpoint.keep_best and not validates:
            raise ValueError(f"checkpoint.keep_best: {self.checkpoint.keep_best} needs validation data "
                             "(data.val_fraction or data.val_path)")
        if self.checkpoint.keep_best and not self.checkpoint.dir:
            raise ValueError("checkpoint.keep_best: needs checkpoints (checkpoint.dir is empty)")
        check_options(self)  # the objective's own checks (`objectives/config.py`)
        if t.compile and self.model.activation_checkpointing == "selective":
            raise ValueError("train.compile: model.activation_checkpointing=selective picks the ops to keep inside a "
                             "block, and a compiled block runs as one op to it; use full or every:N with compile")
        self._check_cp()
        if self.optim.min_lr is not None and self.optim.min_lr > self.optim.lr:
            raise ValueError(f"optim.min_lr: {self.optim.min_lr} exceeds optim.lr ({self.optim.lr})")
        return self

    def _check_cp(self) -> None:
        """What context parallelism does not compose with yet, one line each."""
        p = self.parallel
        if p.cp == 1:
            return
        from rayzero.models import spec_class

        refused = [
            (not spec_class(self.model.kind).splits_sequence,
             f"model.kind={self.model.kind}: attention across a split sequence reaches the built-in GPT's and "
             "transformers' (model.kind=gpt or hf)"),
        ]
        for bad, why in refused:
            if bad:
                raise ValueError(f"parallel.cp {p.cp} with {why}")

    def mesh(self, world_size: int | None = None, rank: int = 0) -> Mesh:
        """The mesh of `world_size` ranks (`cluster.num_workers` unless an elastic resize says
        otherwise), as `rank` sees it; its process groups come when a rank connects it."""
        return Mesh(world_size or self.cluster.num_workers, rank, **self._set_sizes())

    def grad_accum_for(self, mesh: Mesh) -> int:
        """Micro-batches per rank per step on `mesh`: global batch / (micro batch x batch-role size)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * mesh.size("batch"))

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank per step at `cluster.num_workers` ranks."""
        return self.grad_accum_for(self.mesh())

    def world_sizes(self) -> list[int]:
        """The world sizes this run may train at, largest first: `cluster.num_workers`, then
        (elastic) every smaller one down to `cluster.min_workers` that is a multiple of
        `parallel.pp` x `sharding.dp_outer` x `parallel.ep` x `parallel.cp` x `parallel.tp` (a
        smaller world drops whole groups) and whose data-parallel size divides the global batch
        into whole micro-batches."""
        t, c = self.train, self.cluster
        low = c.min_workers or c.num_workers
        return [w for w in range(c.num_workers, low - 1, -1)
                if w == c.num_workers or (fits(w, **self._set_sizes())
                                          and t.global_batch_size % (t.micro_batch_size * self.mesh(w).size("batch")) == 0)]

    def _set_sizes(self) -> dict[str, int]:
        """The mesh's axis sizes the config sets (all but `shard`, which takes the rest)."""
        return {"pp": self.parallel.pp, "replicate": self.sharding.dp_outer, "ep": self.parallel.ep,
                "cp": self.parallel.cp, "tp": self.parallel.tp}

    @property
    def block_size(self) -> int:
        return self.model.block_size or self.train.seq_len

    def flat(self) -> dict[str, Any]:
        """Dotted keys to values, as MLflow parameters."""
        return _flatten(self.model_dump(by_alias=True))


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        elif isinstance(v, dict):
            out[key] = "{}"
        else:
            out[key] = v
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=v` -> (["a", "b"], "v"). The value stays text (validation converts it to the
    field's type, so `tracking.run_name=2024` stays the string "2024"); `null` means None."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=100")
    value = None if raw.strip() in ("null", "None", "~") else raw
    return key.strip().split("."), value


def _adapter_dir(path: str) -> bool:
    """Whether `path` is a local PEFT adapter directory (`model.path` given one: the run's
    model and LoRA settings are its, resolved when the run starts)."""
    return bool(path) and "://" not in path and (Path(path).expanduser() / "adapter_config.json").is_file()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                cls: type[RootConfig] | None = None) -> RootConfig:
    data: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: expected a mapping of sections, got {type(data).__name__}")
    return build_config(apply_overrides(data, overrides), cls)


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """`data` (nested sections) with each `a.b=v` override set in it, in place."""
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for i, k in enumerate(keys[:-1]):
            nxt = node.setdefault(k, {})
            if nxt is None:  # an optional section left out (model.lora): a key of it turns it on
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(keys[: i + 1])}: is a value, not a section")
            node = nxt
        node[keys[-1]] = value
    return data


def build_config(data: dict, cls: type[RootConfig] | None = None) -> RootConfig:
    try:
        return (cls or RootConfig).model_validate(data)
    except ValidationError as e:
        raise ConfigError(explain(e)) from None


def explain(err: ValidationError) -> str:
    for e in err.errors():  # already explained (a TrainConfig validated inside another validation)
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):
            return str(inner)
    lines = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_suggest(e['loc'])}")
        elif not key:  # a cross-field check: its message starts with the key
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = str(e["msg"]).removeprefix("Value error, ")
            field = re.match(r"([a-z_]+)(, [a-z_]+)*: ", msg)
            if isinstance(got, dict) and field and "," not in field.group(0):  # "path: ..." in section model
                key, msg = f"{key}.{field.group(1)}", msg[field.end():]
            lines.append(f"{key}: {msg}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _suggest(loc: tuple) -> str:
    model: Any = RootConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return ""
        model = field.annotation
        inner = [a for a in getattr(model, "__args__", ()) if hasattr(a, "model_fields")]
        model = inner[0] if inner else model  # an optional section (model.lora)
    fields = [f.alias or name for name, f in getattr(model, "model_fields", {}).items()]  # as users type them
    close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    where = ".".join(map(str, loc[:-1])) or "the root"
    return f"{hint} ({where} accepts: {', '.join(fields)})"
