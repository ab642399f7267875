"""Run one training job: resolve the run's paths, check data, connect Ray, drive the controller."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from pathlib import Path

import ray
import torch

from rayzero.storage import StorageError
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.controller import Controller
from rayzero.cluster.local_ray import (
    RayStart, check_local_capacity, check_reachable, local_ray_options, quiet_logs, shutdown_ray, starts_local_ray,
)
from rayzero.cluster.startup import CHECKS, Startup
from rayzero.jobs.tracking import UNSENT, NullTracker, Tracker
from rayzero.cluster.worker_group import KEPT
from rayzero.checkpoint.export import check_destination, check_final, export_identity
from rayzero.config import ConfigError, RootConfig
from rayzero.data.tokens import MASKED_KINDS, DataError, read_meta
from rayzero.models import ModelError, ModelSpec, ModelUnavailable, spec_class
from rayzero.jobs.data_checks import (  # noqa: F401 (resolve_data, open_dataset: named from here too)
    model_tokenizer_dir, resolve_data, open_dataset, steps_in_epochs, note_cut_examples, note_pairs, check_objective,
    check_validation, packs_examples, run_length,
)
from rayzero.jobs.defaults import with_defaults
from rayzero.jobs.preflight import nothing_to_train, resume_preview, resumed_run_dir, say_resume
from rayzero.version import __version__
from rayzero.workers.assembly import (
    Built, build_model, check_buildable, initial_values, make_spec,
)


class ClusterUnreachable(RuntimeError):
    """cluster.address names no reachable Ray cluster."""


class ModelUnreachable(ConfigError):
    """model.path names storage this machine cannot reach."""


def check_data_tokenizer(cfg: RootConfig, meta: dict, data_path: str) -> None:
    """A dataset made with another tokenizer than the model's own is refused: its ids would
    mean other tokens to the model. The model's tokenizer is what `AutoTokenizer` loads from
    `model.path` (as `data prepare --tokenizer MODEL_DIR` loads it), so the advice below makes
    a dataset that passes."""
    model_dir = spec_class(cfg.model.kind).model_dir(cfg.model)
    if model_dir is None:
        return
    from rayzero.models.hf import model_tokenizer

    try:
        mine = model_tokenizer(model_dir, cfg.checkpoint)
    except DataError as e:
        raise DataError(f"model.path: {model_dir} has tokenizer files, but {str(e).split(': ', 1)[-1]}") from None
    if mine is None:
        return
    theirs = meta["tokenizer"]
    if theirs["sha256"] != mine.sha256:
        made = "bytes" if theirs["kind"] == "byte" else (
            f"tokenizer {theirs.get('name', '?')} ({theirs.get('class', 'hf')}, {theirs['sha256']})")
        raise DataError(
            f"data.path: {data_path} was tokenized with {made}, not with the tokenizer of model.path "
            f"{model_dir} ({type(mine.tok).__name__}, {mine.sha256}): prepare it with `rayzero data prepare "
            f"SRC OUT --tokenizer {model_dir}`")


def resolve_factory(cfg: RootConfig, factory=None):
    """The model's callable for `model.kind=module`: `factory` if given from Python, else
    `model.factory` imported here, with the working directory importable (as `python -m`
    has it), so that `model.factory=mymodels:TinyLM` finds `./mymodels.py`. A callable from
    the user's own files (not an installed package) is sent to the ranks by value, so their
    machines need not have the file."""
    if not spec_class(cfg.model.kind).takes_factory():
        return None
    if factory is None:
        from rayzero.models.module import import_factory

        if not cfg.model.factory:
            raise ConfigError("model.factory: model.kind=module needs `package.module:callable` (or, from Python, "
                              "Trainer(config, model=callable))")
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            factory = import_factory(cfg.model.factory)
        except ModelError as e:
            raise ConfigError(str(e)) from None
    _send_by_value(factory)  # the whole top-level package: the factory's module may import its siblings
    return factory


def resolve_objective(cfg: RootConfig, objective: type | None = None) -> type | None:
    """The class of a user's own objective (`train.objective=package.module:Class`, or from
    Python, `objective`), imported here with the working directory importable, checked for what
    the interface needs and against the config (`Objective.check`), and sent to the ranks by
    value where it comes from the user's files; None for a built-in one. A ConfigError in one
    line otherwise, before any cluster is touched."""
    from rayzero.objectives.config import is_path
    from rayzero.objectives.registry import check_class, objective_class, remember

    name = cfg.train.objective
    if objective is not None:
        try:
            remember(name, check_class(objective, name))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif not is_path(name):
        return None
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        cls = objective_class(name)
        cls.check(cfg)
        if cls.reference == "adapters_off" and cfg.model.lora is None:
            raise ValueError("its reference is the base model with the LoRA adapters off (reference = "
                             "\"adapters_off\"), and this run has no adapters: set model.lora, or use frozen_copy")
    except ValueError as e:
        text = str(e)
        raise ConfigError(text if text.startswith("train.objective") else f"train.objective: {name}: {text}") from None
    _send_by_value(cls)
    return cls


def _send_by_value(obj) -> None:
    """The whole top-level package of `obj`'s module pickled by value for the ranks, where it is
    the user's own (not an installed package): their machines need not have the file."""
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    where = getattr(module, "__file__", None) or ""
    if module is not None and module.__name__ != "__main__" and not any(
            part in where for part in ("site-packages", "dist-packages")) and not module.__name__.startswith("rayzero"):
        ray.cloudpickle.register_pickle_by_value(sys.modules[module.__name__.partition(".")[0]])


class Prepared:
    """The model as the driver checks and plans it: its spec, and `built`, the model built on
    the meta device the first time a check, the plan or the resume preview needs it and then
    kept, so that a `rayzero train` or a `--dry-run` builds it once however many read it (what
    they read is its shapes and names; none of them changes it)."""

    def __init__(self, cfg: RootConfig, spec: ModelSpec):
        self.cfg, self.spec = cfg, spec

    @functools.cached_property
    def built(self) -> Built:
        return build_model(self.cfg, self.spec)


def prepare_model(cfg: RootConfig, factory=None, data_vocab: int | None = None, packs: str | None = None) -> Prepared:
    """Everything about the model that can be checked before a cluster starts: that it builds
    (config.json, the factory), that pretrained weights match it, that it fits the sequence
    length and the data's vocabulary, that it keeps packed examples apart (`packs`: what packs
    them, if anything), the FSDP units, the dtypes, the pipeline's split. A ConfigError naming
    the culprit (ModelUnreachable where the model is not readable from here); else the model,
    prepared."""
    try:
        prepared = Prepared(cfg, make_spec(cfg, factory))
        spec = prepared.spec
        spec.check(cfg.train.seq_len, data_vocab)
        if packs:
            spec.check_documents(prepared.built.model, packs)
        check_buildable(cfg, None if cfg.cluster.use_gpu else torch.device("cpu"), spec,
                        build=lambda: prepared.built.model)
        mesh = cfg.mesh()
        if mesh.size("cp") > 1 or mesh.size("ep") > 1 or cfg.moe.router_z_loss:
            prepared.built  # noqa: B018 -- the seam reaches the attention (ulysses splits its heads), the experts,
            # the router's loss
        if mesh.size("pp") > 1:
            from rayzero.jobs.pipeline_plan import check_pipeline

            check_pipeline(cfg, spec, prepared.built.model)
        if cfg.model.adapter:  # onto the model it was trained on, every adapter in its file
            from rayzero.models.lora import check_adapter_base, read_adapter

            check_adapter_base(read_adapter(cfg.model.adapter, cfg.checkpoint), spec.record(), cfg.model.path)
            initial_values(spec, prepared.built)
    except ModelUnavailable as e:
        raise ModelUnreachable(str(e)) from None
    except ModelError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:  # unit classes, dtypes
        raise ConfigError(str(e)) from None
    return prepared


def check_model(cfg: RootConfig, factory=None, data_vocab: int | None = None) -> ModelSpec:
    """`prepare_model`'s checks; the model's spec."""
    return prepare_model(cfg, factory, data_vocab).spec


def adapter_start(cfg: RootConfig) -> RootConfig:
    """A run that starts from a PEFT adapter directory (`model.adapter`, or one given as
    `model.path`), made whole: `model.path` the base it names where not given (an HF model's
    directory: `model.kind=hf`), `model.lora` its settings (ModelError-worded ConfigError where
    a key set here disagrees), both paths absolute. The same config every time it is resolved,
    so that rerunning the command resumes."""
    from rayzero.config import build_config
    from rayzero.models.lora import adapter_settings, read_adapter

    m = cfg.model
    if not (m.adapter or m.path):
        return cfg
    try:
        found = read_adapter(m.adapter or m.path, cfg.checkpoint)
    except ModelUnavailable as e:
        if not m.adapter:
            return cfg  # model.path is checked on its own, where it is read
        raise ModelUnreachable(f"model.adapter: {e}") from None
    except ModelError as e:
        raise ConfigError(f"model.{'adapter' if m.adapter else 'path'}: {e}") from None
    if found is None:
        if m.adapter:
            raise ConfigError(f"model.adapter: {m.adapter} is not a PEFT adapter directory (no adapter_config.json)")
        return cfg
    try:
        lora = adapter_settings(found, m.lora)
    except ModelError as e:
        raise ConfigError(str(e)) from None
    adapter, path = (m.adapter, m.path) if m.adapter else (m.path, "")
    if not m.adapter:
        if not found.base:
            raise ConfigError(f"model.path: {m.path} is a PEFT adapter directory ({found.describe()}) that names no "
                              f"base model: give model.path=BASE_DIR model.adapter={m.path}")
        print(f"rayzero: note: model.path {m.path} is a PEFT adapter directory ({found.describe()}): training on "
              f"from its adapters, on the base it names (model.path={found.base} model.adapter={m.path})",
              file=sys.stderr)
    changes = {"adapter": _absolute(adapter), "lora": lora}
    base = path or found.base
    if base:
        local = "://" not in base or base.startswith("file://")
        if local and not Path(base.removeprefix("file://")).expanduser().exists():
            raise ConfigError(f"model.adapter: {adapter} was trained on {base}, which is not here: give "
                              "model.path=BASE_DIR (that model's directory)")
        changes["path"] = _absolute(base)
        if not path and local:  # the kind of the base it names (an HF model's directory: hf)
            changes["kind"] = spec_class(m.kind).adapter_base_kind(Path(base).expanduser())
    data = cfg.model_dump(by_alias=True, exclude_unset=True)  # what the user left unset stays a default
    data.setdefault("model", {}).update(changes)
    return build_config(data, type(cfg))


def _absolute(path: str) -> str:
    if not path or "://" in path or Path(path).expanduser().is_absolute():
        return path
    return str(Path(path).resolve())


def absolute_model_path(cfg: RootConfig) -> RootConfig:
    """`model.path` made absolute where it is a relative local path: the ranks' processes need
    not share the driver's working directory."""
    path = cfg.model.path
    if not path or "://" in path or Path(path).expanduser().is_absolute():
        return cfg
    return cfg.override(f"model.path={Path(path).resolve()}")


def absolute_data_paths(cfg: RootConfig) -> RootConfig:
    """`data.path` and `data.val_path` made absolute where they are relative local paths, as
    `model.path` is: ranks on a cluster started elsewhere do not share the driver's working
    directory."""
    relative = [(key, value) for key in ("path", "val_path") if (value := getattr(cfg.data, key))
                and "://" not in value and not Path(value).expanduser().is_absolute()]
    return cfg.override(*(f"data.{key}={Path(value).resolve()}" for key, value in relative)) if relative else cfg


def make_run_dir(cfg: RootConfig) -> Path:
    name = cfg.tracking.run_name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.train.output_dir).expanduser().resolve() / name
    suffix = 1
    while run_dir.exists():
        run_dir = run_dir.with_name(f"{name}-{suffix}")
        suffix += 1
    run_dir.mkdir(parents=True)
    return run_dir


def given_compile_cache(cfg: RootConfig) -> Path | None:
    """`train.compile_cache` made absolute (ranks do not share the driver's working directory);
    None where it is not given."""
    return Path(cfg.train.compile_cache).expanduser().resolve() if cfg.train.compile_cache else None


def with_compile_cache(cfg: RootConfig, run_dir: Path) -> RootConfig:
    """`train.compile`'s caches where the ranks find them: `given_compile_cache`, else the run
    directory's `compile_cache`, which a restart, a spare and the resumed run share. The config
    saved in the run directory keeps what was given."""
    if not cfg.train.compile or cfg.train.compile_backend != "inductor":
        return cfg
    cache = given_compile_cache(cfg) or run_dir / "compile_cache"
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile_cache": str(cache)})})


def tracking_uri(cfg: RootConfig, run_dir: Path) -> str:
    return cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"


def run_train(cfg: RootConfig, progress: bool = True, factory=None, startup: Startup | None = None,
              ray_start: RayStart | None = None) -> dict:
    """Train; the run's summary (what `rayzero train --summary-json` writes)."""
    return train_run(cfg, progress, factory, startup, ray_start)[0]


def train_run(cfg: RootConfig, progress: bool = True, factory=None, startup: Startup | None = None,
              ray_start: RayStart | None = None, objective: type | None = None,
              rewards: tuple = ()) -> tuple[dict, list[dict]]:
    """Train; the run's summary and each step's metrics (one dict per step, from step 0 on a
    resumed run too). `factory`: the model's callable, given from Python (`model.kind=module`);
    `objective`: the class of the run's objective, given from Python (`train.objective`);
    `rewards`: reward functions given from Python (online RL, after `grpo.reward_funcs`);
    `startup`: the start-up's status lines, begun by the caller (None: begun here); `ray_start`:
    the start (or join) of the Ray this run uses, and its ranks' placement, begun by the caller
    beside its imports (the CLI in a process of its own; None: Ray is started or joined after the
    checks, and the ranks placed after that). The caller stops it (`RayStart.stop`) once this
    returns or raises."""
    if startup is None:
        startup = Startup()
        startup.stage("checks", CHECKS)
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if KEPT.connection is not None and (not cfg.cluster.keep_ranks or KEPT.connection != address):
        KEPT.release()  # ranks kept by an earlier run, and its Ray connection, are not this run's
    if ray_start is None and starts_local_ray(cfg):  # before anything is written: not after the placement wait
        check_local_capacity(cfg)  # (a begun RayStart checked it before it began)
    objective = resolve_objective(cfg, objective)  # a user's own: imported and checked now
    # S3 settings left to the AWS variables are resolved here, once, for the driver's checks and
    # for the ranks alike (Ray starts them without this environment); the run directory's
    # config.json and MLflow show the settings as given.
    given_storage = cfg.checkpoint
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.with_environment()})
    cfg = adapter_start(cfg)
    cfg, defaults = with_defaults(cfg)
    startup.say(defaults.line())
    cfg = absolute_data_paths(cfg)
    data_path = resolve_data(cfg)
    cfg = absolute_model_path(cfg)
    if cfg.train.save_final:
        try:
            check_destination(cfg.train.save_final, cfg.checkpoint)
        except ValueError as e:
            raise ConfigError(f"train.save_final: {cfg.train.save_final!r} cannot be written: {e}") from None
    # The model, its weights, units and dtypes: fail here, before any cluster is touched.
    factory = resolve_factory(cfg, factory)
    meta = read_meta(data_path, cfg.checkpoint)
    check_data_tokenizer(cfg, meta, data_path)
    check_objective(cfg.train.objective, "data.path", data_path, meta)
    if cfg.data.val_path:
        check_objective(cfg.train.objective, "data.val_path", cfg.data.val_path, read_meta(cfg.data.val_path, cfg.checkpoint))
    dataset = open_dataset(cfg, data_path) if (cfg.data.epochs or cfg.data.val_path or cfg.data.val_fraction
                                                or meta.get("kind") in MASKED_KINDS) else None
    check_validation(cfg, meta, dataset)
    note_cut_examples(cfg, meta, dataset)
    cfg, words, length = run_length(cfg, dataset)
    if words:
        startup.say(words)
    prepared = prepare_model(cfg, factory, data_vocab=meta["vocab_size"], packs=packs_examples(cfg, meta))
    spec = prepared.spec
    driver_side = make_driver_side(cfg, data_path, spec, rewards, factory)
    if driver_side is None or not cfg.cluster.keep_ranks:
        KEPT.discard_rollouts()  # rollout actors an earlier run kept, not this run's
    note = vocab_note(cfg, prepared.built) if cfg.mesh().size("tp") > 1 and cfg.parallel.vocab_parallel else None
    if note:
        print(f"rayzero: note: {note}", file=sys.stderr)
    if cfg.train.save_final:
        try:
            check_final(cfg.train.save_final, cfg.train.save_format, export_identity(spec.record()),
                        cfg.train.overwrite_final, cfg.checkpoint)
        except ValueError as e:
            raise ConfigError(f"train.save_final: {cfg.train.save_final}: {e}") from None
    checkpoints, resume = None, None
    if cfg.checkpoint.dir:  # a probe write now, not a failed upload after an hour of training
        try:
            checkpoints = Checkpoints(cfg)
            checkpoints.probe()
        except StorageError as e:
            raise ConfigError(f"checkpoint.dir: cannot write checkpoints there: {e}") from None
        resume = resume_preview(checkpoints, spec, prepared.built)
    if resume is not None and (done := nothing_to_train(cfg, resume)) is not None:
        return done
    if resume is not None:
        say_resume(cfg, resume, length)
    resumed_dir = resumed_run_dir(resume)
    run_dir = resumed_dir or make_run_dir(cfg)
    shown = cfg.model_copy(update={"checkpoint": given_storage})
    (run_dir / "config.json").write_text(shown.model_dump_json(indent=2, by_alias=True))
    cfg = with_compile_cache(cfg, run_dir)
    quiet_logs()
    started_ray = ray_start is not None or not ray.is_initialized()
    startup.stage("ray", ray_words(address, started_ray)
                  + (f" (begun at {ray_start.began_s:.1f}s, beside the checks)" if ray_start is not None else ""))
    if started_ray:
        try:
            if ray_start is not None:
                ray_start.wait()
            else:
                check_reachable(address)
                ray.init(address=cfg.cluster.address or None, logging_level="WARNING", log_to_driver=True,
                         **local_ray_options(cfg))
        except ConnectionError as e:
            if resumed_dir is None:  # the run directory this run made holds nothing yet but its config
                shutil.rmtree(run_dir, ignore_errors=True)
            key = "cluster.address" if cfg.cluster.address else "RAY_ADDRESS"
            raise ClusterUnreachable(
                f"{key}: cannot connect to a Ray cluster at {address!r}: "
                f"{e}" + ("" if "token authentication" in str(e) else
                          ". Leave it empty to start a local Ray; for a cluster with token authentication "
                          "set RAY_AUTH_MODE=token.")
            ) from None
    tracker = NullTracker()
    if cfg.tracking.enabled:
        tags = {"strategy": cfg.sharding.strategy, "world_size": cfg.cluster.num_workers,
                "rayzero_version": __version__, "run_dir": str(run_dir)}
        if checkpoints is not None:
            tags["checkpoint_dir"] = checkpoints.root.uri
        uri = tracking_uri(cfg, run_dir)
        local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
        tracker = Tracker(uri, cfg.tracking.experiment, cfg.tracking.run_name or run_dir.name, shown.flat(), tags,
                          artifact_dir=str(run_dir / "artifacts") if local else None,
                          artifacts=[str(run_dir / "config.json")], spill_path=str(run_dir / UNSENT),
                          unsent=str(run_dir / UNSENT),  # what an earlier run of this directory could not send
                          flush_timeout_s=cfg.tracking.flush_timeout_s,
                          resume=(resume.manifest.get("mlflow_run_id"), resume.step) if resume is not None else None,
                          held=True)
        startup.when_done(tracker.begin)  # MLflow takes no CPU from the ranks' start
    try:
        controller = Controller(cfg, data_path, str(run_dir), tracker, progress=progress, checkpoints=checkpoints,
                                factory=factory, objective=objective, spec=spec, startup=startup,
                                driver_side=driver_side)
        return controller.fit(), controller.history.rows
    finally:
        if KEPT.group is not None:  # kept ranks live as long as this process's connection
            KEPT.connection = KEPT.connection or (address if started_ray else None)
        elif started_ray or KEPT.connection is not None:  # nothing kept: a connection made for them goes
            KEPT.connection = None
            shutdown_ray()


def make_driver_side(cfg: RootConfig, data_path: str, spec, rewards=(), factory=None):
    """The objective's part on the driver (online RL's rollouts), checked against the run, or
    None; ConfigError in one line for what cannot run (a reward that does not import, a prompt
    too long, a replay file that does not match)."""
    from rayzero.objectives.registry import objective_for

    if not objective_for(cfg).samples:
        if rewards:
            raise ConfigError(f"rewards: train.objective={cfg.train.objective} samples nothing to reward "
                              "(online RL: train.objective=grpo)")
        return None
    try:
        from rayzero.jobs.rollouts import rollouts_for

        side = rollouts_for(cfg, data_path, spec, tuple(rewards), factory)
        side.check(cfg.train.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return side


def ray_words(address: str, connects: bool) -> str:
    """The start-up's line for Ray: which one the run starts, joins or finds."""
    if not connects:
        return "using the Ray this process is connected to"
    if not address:
        return "starting a local Ray"
    return "joining the Ray cluster " + ("this machine is part of" if address == "auto" else f"at {address}")


def vocab_note(cfg: RootConfig, built) -> str | None:
    """Why the vocabulary is not split over the TP ranks although `parallel.vocab_parallel`
    asks for it, and what is done instead (None: it is split, or not asked for)."""
    if built.tp is None or built.tp.vocab_note is None:  # a note only where the split was asked for
        return None
    return (f"parallel.vocab_parallel: {type(built.model).__name__}'s vocabulary is not split over the "
            f"{cfg.mesh().size('tp')} tensor-parallel ranks, as {built.tp.vocab_note}; its embedding and head stay whole "
            "on every TP rank, with the full logits on each (parallel.vocab_parallel=false asks for that)")
