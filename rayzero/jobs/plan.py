"""`rayzero train --dry-run`: what a run of a config would do, checked as far as possible
without data or Ray (the config, the model on the meta device), in the run's own terms: how the
ranks split the work and what each holds, where it would start (its resume, or its refusal), and
how many warm spares would fit. `rayzero deploy check` asks the same of a job's entrypoint."""

from __future__ import annotations

import os

import ray

from rayzero.cluster.checkpoints import Checkpoints
from rayzero.config import ConfigError, RootConfig
from rayzero.cluster.local_ray import check_local_capacity, check_reachable, quiet_logs, starts_local_ray
from rayzero.jobs.preflight import nothing_to_train, resume_preview
from rayzero.jobs.data_checks import data_plan
from rayzero.jobs.defaults import Defaults, with_defaults
from rayzero.jobs.train import (
    ModelUnreachable, absolute_data_paths, absolute_model_path, adapter_start, prepare_model,
    given_compile_cache, resolve_factory, resolve_objective, vocab_note,
)
from rayzero.models import ModelSpec, spec_class
from rayzero.storage import StorageError
from rayzero.workers.assembly import bucket_layout, whole_counts


def plan(cfg: RootConfig, factory=None, read_model: bool = True, local: bool | None = None, job: bool = False) -> dict:
    """What `run_train(cfg)` would do, checked as far as possible without data or Ray: the
    config and the model (built on the meta device; its weights' headers read) are validated
    (ConfigError), and the plan says how the ranks split the work and what each holds
    (Megatron's model-state formula). A model whose storage this machine cannot reach (an
    S3 endpoint only the cluster sees; with `read_model=False`, any) is left out of the plan,
    with a note saying so. `local`: whether the run starts a Ray of its own here, which must
    then fit this machine (default: as `starts_local_ray` finds). `job`: the plan of a job that
    runs on its cluster (`rayzero deploy check`): its checkpoints are the cluster's to read, and
    where it resumes is not said."""
    from rayzero.cluster.checkpoints import checkpoint_root
    from rayzero.cluster.schedule import describe as describe_schedule
    from rayzero.objectives.registry import objective_for
    from rayzero.sharding.memory import activation_bytes, formula_bytes_per_param
    from rayzero.sharding.precision import DTYPES

    local = starts_local_ray(cfg) if local is None else local
    if local:
        check_local_capacity(cfg)

    resolve_objective(cfg)  # a user's own objective: imported and checked as the run checks it
    mesh = cfg.mesh()  # rank 0's place: the axes' sizes, by role (the adapter's start changes none of them)
    defaults = (Defaults("pretraining", "model.path is read on the cluster's machines: the fine-tuning defaults "
                         "apply if it holds weights") if cfg.model.path or cfg.model.adapter else with_defaults(cfg)[1])
    data = None
    try:
        if not read_model:
            raise ModelUnreachable(f"model.path {cfg.model.path} is on the cluster's machines")
        cfg = adapter_start(cfg)
        cfg, defaults = with_defaults(cfg)
        cfg, data = data_plan(cfg)
        prepared, note = prepare_model(cfg, resolve_factory(cfg, factory), packs=data["packs"]), None
        spec, built = prepared.spec, prepared.built  # what the ranks will shard (one TP rank's share)
        model = built.model
        num_params, trainable = spec.num_params(model)  # per TP rank
        whole_params, whole_trainable = whole_counts(model, built.tp)  # the whole model's
        buckets = [b.world.size for b in bucket_layout(cfg, spec, model).buckets]
        record = spec.record()
        shape = spec.activation_shape(model)
        lora = lora_line(cfg, model)
        vocab = {"parallel": built.tp is not None and built.tp.vocab is not None, "note": vocab_note(cfg, built)}
        stages = None
        if mesh.size("pp") > 1:
            from rayzero.jobs.pipeline_plan import check_pipeline

            stages = check_pipeline(cfg, spec, model)
    except ModelUnreachable as e:
        spec, note, num_params, trainable, buckets = None, f"not read from here: {e}", None, None, None
        whole_params = whole_trainable = None
        lora, vocab = None, {"parallel": mesh.size("tp") > 1 and cfg.parallel.vocab_parallel, "note": None}
        record = {"kind": cfg.model.kind, "source": cfg.model.path, "init": cfg.model.init}
        shape = stages = built = None
    sh, t, c = cfg.sharding, cfg.train, cfg.cluster
    d = mesh.size("grad_shard")  # ranks a shard is split over
    param_bytes = DTYPES[sh.param_dtype].itemsize
    grad_bytes = DTYPES[sh.grad_dtype].itemsize
    d_optim = mesh.size("grad_reduce") if sh.dp_outer > 1 and sh.outer_strategy == "optim" else d
    per_param = formula_bytes_per_param(sh.strategy, d, param_bytes, grad_bytes, d_optim)
    # Frozen parameters hold only their compute copy (sharded under ZeRO-3).
    frozen_per_param = param_bytes / (d if sh.strategy == "optim_grads_params" else 1)
    # Per rank: its tensor-parallel share of the parameters (split ones / tp, replicated whole).
    bytes_per_rank = (int(per_param * trainable + frozen_per_param * (num_params - trainable))
                      if num_params else None)
    experts = experts_plan(cfg, built, mesh) if built is not None else None
    if experts is not None and bytes_per_rank is not None:  # the experts shard over their own, smaller group
        d_e = mesh.size("expert_shard")
        e_param = formula_bytes_per_param(sh.strategy, d_e, param_bytes, grad_bytes, d_e)
        e_frozen = param_bytes / (d_e if sh.strategy == "optim_grads_params" else 1)
        bytes_per_rank += int((e_param - per_param) * experts["trainable_per_rank"]
                              + (e_frozen - frozen_per_param) * (experts["params_per_rank"] - experts["trainable_per_rank"]))
        experts["bytes_per_param"] = e_param
    act = activation_bytes(  # a cp rank holds its 1/cp of each sequence
        shape, t.seq_len // mesh.size("cp"), t.micro_batch_size, param_bytes, cfg.model.checkpoint_every,
        cfg.model.activation_checkpointing == "selective", mesh.size("tp"),
        cfg.parallel.sequence_parallel, vocab["parallel"]) if shape is not None else None
    pipeline = None
    if stages is not None:
        from rayzero.jobs.pipeline_plan import pipeline_plan

        pipeline = pipeline_plan(cfg, stages, model, per_param, frozen_per_param, act)
        bytes_per_rank = max(r["bytes_per_rank"] for r in pipeline["ranks"])  # the fullest stage's
        num_params = max(r["params"] for r in pipeline["ranks"])
    # Where the run would start: read as the run reads it (the same refusals), unless the
    # checkpoints are the cluster's to read (a job's plan) or the model is not read here.
    resume = resume_plan(cfg, spec, built) if spec is not None and cfg.checkpoint.dir and not job else None
    return {
        "objective": objective_for(cfg).plan(num_params, frozen_per_param, sh.param_dtype),
        "rollouts": objective_for(cfg).rollout_plan(whole_params, whole_trainable),
        "pipeline": pipeline,
        "world_size": c.num_workers,
        "tp": mesh.size("tp"),
        "cp": mesh.size("cp"),
        "cp_mode": cfg.parallel.cp_mode,
        "ep": mesh.size("ep"),
        "experts": experts,  # expert parallelism: each rank's experts and their state
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "vocab_parallel": vocab["parallel"],
        "vocab_note": vocab["note"],
        "mesh": mesh.describe(),
        "world_sizes": cfg.world_sizes(),
        "cluster": c.address or "local Ray",
        "bundle": c.bundle,
        "strategy": sh.strategy,
        "dp_outer": sh.dp_outer,
        "param_dtype": sh.param_dtype,
        "grad_dtype": sh.grad_dtype,
        "num_params": whole_params,  # the whole model's
        "trainable_params": whole_trainable,
        "params_per_rank": num_params,
        "model": {"kind": record["kind"], "source": record.get("source"), "init": record.get("init"),
                  "architecture": spec_class(record["kind"]).architecture(record),
                  "note": note, "lora": lora},
        "compile": t.compile_backend if t.compile else None,  # torch.compile of each block, its backend
        # inductor's caches, as the ranks get them; None: the run directory's compile_cache
        "compile_cache": str(cache) if (cache := given_compile_cache(cfg)) else None,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "dp_size": mesh.size("batch"),  # the ranks the global batch is split over (not tp, not pp)
        "tokens_per_step": t.global_batch_size * t.seq_len,
        "steps": t.steps,
        "schedule": describe_schedule(t.steps, cfg.optim),
        "buckets": {"numel": buckets, "bucket_numel": sh.bucket_numel,
                    "per_unit": sh.strategy == "optim_grads_params"},
        "memory": {"bytes_per_param": bytes_per_rank / num_params if num_params else per_param,
                   "bytes_per_rank": bytes_per_rank,
                   # a micro-batch's saved activations, estimated from the model's shape (None: unknown)
                   "activations_bytes": act,
                   "activation_checkpointing": cfg.model.activation_checkpointing},
        "checkpoint": ({"dir": checkpoint_root(cfg), "every_steps": cfg.checkpoint.every_steps,
                        "resume": cfg.checkpoint.resume, "start": resume} if cfg.checkpoint.dir else None),
        "tracking": (cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite in the run directory")
        if cfg.tracking.enabled else None,
        "data": data["path"] if data else cfg.data.path or "the default corpus (prepared on first use)",
        "defaults": defaults.line(),
        "length": data["length"] if data else None,  # what sets the run's length (data.epochs)
        "cut": data["cut"] if data else None,  # the instruction examples the windows cut
        "data_note": data["note"] if data else None,
        "failure": {"max_restarts": cfg.failure.max_restarts, "phase_timeout_s": cfg.failure.phase_timeout_s,
                    "spares": cfg.failure.spares,  # a job's room is its cluster's, not measured from here
                    "spare_room": spare_room(cfg, local) if cfg.failure.spares and not job else None},
    }


def resume_plan(cfg: RootConfig, spec: ModelSpec, built=None) -> dict:
    """Where a run of `cfg` starts, found as the run finds it (`resume_preview`: a checkpoint of
    another model or objective is refused here too, ConfigError): {"from": the commit's URI or
    None, "step", "of": train.steps, "nothing_to_train"}; with checkpoints this process cannot
    read (storage only the cluster reaches, as for the model), "note" says so instead."""
    from rayzero.checkpoint.manifest import CheckpointError
    from rayzero.jobs.preflight import CheckpointsUnreadable

    cfg = absolute_model_path(absolute_data_paths(cfg))
    try:
        checkpoints = Checkpoints(cfg)
        checkpoints.root.list_dirs()  # readable from here at all
        resume = resume_preview(checkpoints, spec, built)
    except (StorageError, CheckpointsUnreadable) as e:
        return {"from": None, "step": None, "of": cfg.train.steps, "nothing_to_train": False,
                "note": f"not read from here: {str(e).removeprefix('checkpoint.dir: ')}"}
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if resume is None:
        return {"from": None, "step": 0, "of": cfg.train.steps, "nothing_to_train": False}
    return {"from": resume.uri, "step": resume.step, "of": cfg.train.steps,
            "nothing_to_train": nothing_to_train(cfg, resume) is not None}


def spare_room(cfg: RootConfig, local: bool) -> dict:
    """How many of `failure.spares` would be placed: each takes a rank's bundle, beside the
    ranks. Measured on this machine for a run that starts its own Ray (`local`), else on the
    cluster at `cluster.address` (its free resources now) when this process can reach it:
    {"fit": n, "on": what was measured} ("fit" None: not measured, "on" says why)."""
    c = cfg.cluster
    need = c.bundle
    if local:
        from rayzero.cluster.local_ray import local_capacity

        have, on = local_capacity(), "this machine"
    else:
        address = c.address or os.environ.get("RAY_ADDRESS", "")
        try:
            have, on = cluster_free(address), f"the cluster at {address or 'RAY_ADDRESS'}, free now"
        except ConnectionError as e:
            return {"fit": None, "on": f"not measured: {e}"}
    room = min((have.get(k, 0.0) - c.num_workers * each) / each for k, each in need.items())
    fit = max(0, min(cfg.failure.spares, int(room + 1e-9)))
    said = ", ".join(f"{have.get(k, 0.0):g} {k}" for k in need)
    return {"fit": fit, "on": f"{on} ({said}; the {c.num_workers} ranks take "
                              + ", ".join(f"{c.num_workers * each:g} {k}" for k, each in need.items()) + ")"}


def cluster_free(address: str) -> dict[str, float]:
    """The free resources of the Ray cluster at `address` (this process's, if connected);
    ConnectionError if it cannot be reached. A connection made here is closed again."""
    if ray.is_initialized():
        return dict(ray.available_resources())
    check_reachable(address)
    quiet_logs()
    try:
        ray.init(address=address or None, logging_level="ERROR", log_to_driver=False)
    except ConnectionError:
        raise
    except Exception as e:  # noqa: BLE001 (whatever Ray raises for a cluster it cannot join)
        raise ConnectionError(f"{address}: {e}") from None
    try:
        return dict(ray.available_resources())
    finally:
        ray.shutdown()


def experts_plan(cfg: RootConfig, built, mesh) -> dict | None:
    """With `parallel.ep`: the experts a rank holds of each MoE layer and their parameters (the
    tensors expert parallelism split), and the ranks their bucket group reduces over."""
    if mesh.size("ep") == 1 or built.tp is None:
        return None
    split = [n for n, s in built.tp.split.items() if s.axis == "ep"]
    if not split:
        return None
    params = dict(built.model.named_parameters())
    return {"total": built.tp.global_shape[split[0]][0], "local": params[split[0]].shape[0],
            "params_per_rank": sum(params[n].numel() for n in split),
            "trainable_per_rank": sum(params[n].numel() for n in split if params[n].requires_grad),
            "reduce_over": mesh.size("expert_dp"), "capacity_factor": cfg.moe.capacity_factor}


def lora_line(cfg: RootConfig, model) -> str | None:
    """What LoRA adapts, in a few words (None without LoRA)."""
    lora = cfg.model.lora
    if lora is None:
        return None
    from rayzero.models.lora import adapters_of

    layers = adapters_of(model)
    kinds = sorted({a.module.rpartition(".")[2] for a in layers.values()})
    saved = f"; {', '.join(lora.modules_to_save)} trained whole" if lora.modules_to_save else ""
    return (f"LoRA r={lora.r} alpha={lora.alpha:g} dropout={lora.dropout:g} on {len(layers)} linear layers "
            f"({', '.join(kinds)}){saved}")
