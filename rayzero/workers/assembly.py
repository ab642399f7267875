"""How a rank assembles its model: one place, one fixed order.

    build on meta → adapters → tensor parallel → expert parallel → context parallel → compiled blocks (on the ranks)
                  → activation checkpointing
                  → pipeline stage (the blocks and ends of this rank's stages; the rest stand-ins)
                  → sharding strategy (over whatever the steps before left local)
                  → initial values, per name (their source matched to the whole model's names,
                    before the pipeline stage keeps part of it)

Each step is a function of the model, the config and the spec (the model seam) and knows no
model class; the names checkpoints, exports and pretrained weights see stay the model's own at
every step. The rank runs all of them (`assemble`); the driver's checks run the same model
steps on the meta device (`build_model`, `check_buildable`, `bucket_layout`) before anything
starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from rayzero.config import RootConfig
from rayzero.models import ModelSpec, model_spec
from rayzero.pipeline.stages import StagePlan, Stages, plan_stages, split, tied_axis
from rayzero.sharding import Layout, Mesh, ShardingConfig, Strategy, build_strategy
from rayzero.sharding.comm import Axis
from rayzero.sharding.finalize import Tied
from rayzero.sharding.flat_buffer import ParamSource, PerName, Zeros
from rayzero.sharding.fsdp import class_names, find_units
from rayzero.sharding.tensor_parallel import TPLayout, TPSlices
from rayzero.sharding.precision import DTYPES, check_device_supports
from rayzero.sharding.rng import RandomStreams
from rayzero.workers.activations import blocks_of, checkpoint_activations
from rayzero.workers.compile import compile_blocks, hooks_stay_eager


def make_spec(cfg: RootConfig, factory: Callable | None = None) -> ModelSpec:
    """The model seam for this config (`factory`: a callable given from Python); ModelError."""
    return model_spec(cfg.model, seed=cfg.train.seed, block_size=cfg.block_size, storage_cfg=cfg.checkpoint,
                      factory=factory)


@dataclass
class Built:
    """A model after the steps before sharding, and the names those steps added to it."""

    model: nn.Module
    added: frozenset[str] = frozenset()  # parameters the files are never asked for (adapters)
    adapters: dict = field(default_factory=dict)  # LoRA: base weight name -> `lora.Adapter`
    tp: TPLayout | None = None  # what tensor (and expert) parallelism split, each split tensor's global shape
    ep: object = None  # expert parallelism's `ExpertParallel`: the MoE layers' dispatch and its loads
    stages: Stages | None = None  # the pipeline stages this rank holds
    compiled: list[str] = field(default_factory=list)  # the blocks `train.compile` compiled, by name


# -- the steps, in order ---------------------------------------------------------------------------

def build_model(cfg: RootConfig, spec: ModelSpec, mesh: Mesh | None = None,
                streams: RandomStreams | None = None, compiled: bool = False, experts=None) -> Built:
    """Build on meta → adapters → tensor parallel → expert parallel → context parallel → (`compiled`) compiled
    blocks → activation
    checkpointing: the model a strategy shards (parameters still on the meta device). `mesh`:
    this rank's, connected (the driver's checks pass none and build on the config's: the shapes
    are the same on every rank). `streams`: the rank's dropout streams, which the TP regions
    switch and a recompute replays. `compiled`: a rank's build with `train.compile` (the
    driver's checks never compile: compilation changes no shape). `experts`: the rank's
    `ExpertParallel` (with `parallel.ep`; the driver's checks make their own)."""
    built = Built(spec.build())
    add_adapters(built, cfg, spec)
    tensor_parallel(built, cfg, spec, (mesh or cfg.mesh()).axis("tp"), streams)
    expert_parallel(built, cfg, spec, mesh or cfg.mesh(), experts)
    context_parallel(built, cfg, spec, mesh or cfg.mesh(), compiled)
    spec.router_z_loss(built.model, cfg.moe.router_z_loss)
    if compiled:
        compile_model_blocks(built, cfg, spec)
    recompute_blocks(built, cfg, spec, streams)
    return built


def whole_shapes(model: nn.Module, tp: TPLayout | None) -> dict[str, list[int]]:
    """Every parameter's whole shape, as checkpoints record them (a TP rank holds a slice of the
    split ones): what a resume compares, at any TP size."""
    shapes = tp.global_shape if tp is not None else {}
    return {n: list(shapes.get(n, p.shape)) for n, p in model.named_parameters()}


def identity(model: nn.Module, tp: TPLayout | None, spec: ModelSpec) -> dict:
    """What a checkpoint records of the model a rank built, and what a resume compares with it
    (`resume_preview`, from the driver's build of the same config): every parameter's whole
    shape (at any TP size), the frozen parameters' names, and the model's record."""
    return {"params": whole_shapes(model, tp),
            "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
            "model": spec.record()}


def whole_counts(model: nn.Module, tp: TPLayout | None) -> tuple[int, int]:
    """(parameters, of which trainable) of the whole model, from one tensor-parallel rank's
    share: each split tensor counted at its whole shape, a tied one once."""
    shapes = whole_shapes(model, tp)
    sizes = [(math.prod(shapes[n]), p.requires_grad) for n, p in model.named_parameters()]
    return sum(n for n, _ in sizes), sum(n for n, trains in sizes if trains)


def add_adapters(built: Built, cfg: RootConfig, spec: ModelSpec) -> None:
    """`model.lora`: PEFT's LoRA layers, the base frozen, the model's own names kept
    (`models/lora.py`). ModelError for targets that cannot take an adapter."""
    if cfg.model.lora is None:
        return
    from rayzero.models.lora import add_lora

    built.added, built.adapters = add_lora(built.model, cfg.model.lora)


def tensor_parallel(built: Built, cfg: RootConfig, spec: ModelSpec, axis: Axis,
                    streams: RandomStreams | None = None) -> None:
    """`parallel.tp`: the model's plan (`spec.tp_plan`) splits its attention and MLP linears
    over the TP group, and (`parallel.vocab_parallel`) its embedding and head over the
    vocabulary (`sharding/tensor_parallel.py`). ModelError for a model without a plan, TPError
    for sizes that do not divide."""
    if axis.size == 1:
        return
    p = cfg.parallel
    built.tp = spec.parallelize(built.model, axis, p.sequence_parallel, p.vocab_parallel, streams)


def expert_parallel(built: Built, cfg: RootConfig, spec: ModelSpec, mesh: Mesh, experts=None) -> None:
    """`parallel.ep`: each MoE layer keeps this rank's E/ep experts, and its tokens go to their
    experts' ranks and back (`spec.expert_parallel`, `sharding/expert_parallel.py`); the split
    tensors join the layout as TP's do (split along dim 0 over the `ep` role), so that
    initial and pretrained values are read by range and checkpoints hold whole tensors.
    ModelError for a model without experts, or experts ep does not divide."""
    if mesh.size("ep") == 1:
        return
    from rayzero.sharding.expert_parallel import ExpertParallel
    from rayzero.sharding.tensor_parallel import Split

    built.ep = experts or ExpertParallel.from_config(mesh.axis("ep"), cfg)
    whole = spec.expert_parallel(built.model, built.ep)
    if built.tp is None:
        built.tp = TPLayout(1, 0)
    built.tp.ep = (mesh.size("ep"), mesh.coord("ep"))
    for name, shape in whole.items():
        built.tp.split[name] = Split(0, axis="ep")
        built.tp.global_shape[name] = shape


def context_parallel(built: Built, cfg: RootConfig, spec: ModelSpec, mesh: Mesh, compiled: bool = False) -> None:
    """`parallel.cp`: the model's attention runs across the sequence split and its positions are
    the tokens' global ones (`spec.context_parallel`, `sharding/context_parallel.py`); in blocks
    about to be compiled, the attention stays out of the compiled graphs. ModelError for a model
    whose attention the seam cannot reach, ValueError for heads `ulysses` cannot split."""
    cp = context_of(cfg, mesh)
    if cp is not None:
        spec.context_parallel(built.model, cp.kept_eager() if compiled and cfg.train.compile else cp)
        spec.cp = cp  # what the seam's forward asks the split of (a packed row's tokens' indices)


def context_of(cfg: RootConfig, mesh: Mesh):
    """This rank's place in its cp group (None without context parallelism): what splits its
    sequences and runs attention across them."""
    if mesh.size("cp") == 1:
        return None
    from rayzero.sharding.context_parallel import ContextParallel

    return ContextParallel(mesh.axis("cp"), cfg.parallel.cp_mode, cfg.train.seq_len, mesh.size("tp"))


def block_classes(cfg: RootConfig, spec: ModelSpec, model: nn.Module) -> tuple[str, ...]:
    """The classes of the blocks that are compiled and recomputed: `model.recompute_blocks`,
    else the model's own (`spec.blocks`)."""
    return tuple(cfg.model.recompute_blocks) or spec.blocks(model)


def compile_model_blocks(built: Built, cfg: RootConfig, spec: ModelSpec) -> None:
    """`train.compile`: each of the model's blocks (the classes activation checkpointing and
    the pipeline stages take, `spec.blocks`) compiled with `train.compile_backend`
    (`workers/compile.py`)."""
    if not cfg.train.compile:
        return
    built.compiled = blocks_of(built.model, block_classes(cfg, spec, built.model), 1)
    compile_blocks(built.model, built.compiled, cfg.train.compile_backend, cfg.train.compile_cache)


def recompute_blocks(built: Built, cfg: RootConfig, spec: ModelSpec, streams: RandomStreams | None = None) -> None:
    """`model.activation_checkpointing`: the chosen blocks recompute their activations in
    backward, replaying the dropout streams' draws. ValueError for blocks that cannot be found."""
    every = cfg.model.checkpoint_every
    if not every:
        return
    blocks = blocks_of(built.model, block_classes(cfg, spec, built.model), every)
    checkpoint_activations(built.model, blocks, selective=cfg.model.activation_checkpointing == "selective",
                           streams=streams)


def stage_plan(cfg: RootConfig, spec: ModelSpec, model: nn.Module) -> StagePlan:
    """`parallel.pp`: the model's blocks cut into stages (`pipeline/stages.py`); PipelineError,
    ModelError."""
    p = cfg.parallel
    return plan_stages(model, spec.stage_blocks(model), p.pp, p.pp_virtual_stages, p.pp_layers)


def pipeline_stage(built: Built, cfg: RootConfig, spec: ModelSpec, mesh: Mesh) -> None:
    """Keep this rank's stages of the model; the modules of other ranks' become stand-ins. After
    the steps that name modules of the whole model (TP's plan, recompute's blocks), before the
    strategy: it shards only what the stages hold."""
    if mesh.size("pp") == 1:
        return
    plan = stage_plan(cfg, spec, built.model)
    routers = spec.routers(built.model)  # hooked on the whole model, counted per stage, before the split
    modules = dict(built.model.named_modules())
    counts = [sum(routers.count(modules[b]) for b in plan.stage_blocks(s)) for s in range(plan.num_stages)
              ] if routers is not None else []
    built.stages = split(built.model, plan, mesh.coord("pp"))
    built.stages.routers, built.stages.routers_in = routers, counts


def fsdp_units(cfg: RootConfig, spec: ModelSpec, model: nn.Module) -> tuple[str, ...]:
    """ZeRO-3's unit classes: `sharding.fsdp_units`, or the model's own."""
    return tuple(cfg.sharding.fsdp_units) or spec.fsdp_units(model)


def resolved_sharding(cfg: RootConfig, spec: ModelSpec, model: nn.Module) -> ShardingConfig:
    """`cfg.sharding` with ZeRO-3's unit classes filled in from the model where left open."""
    if cfg.sharding.strategy != "optim_grads_params":
        return cfg.sharding
    return cfg.sharding.model_copy(update={"fsdp_units": fsdp_units(cfg, spec, model)})


def initial_values(spec: ModelSpec, built: Built) -> ParamSource:
    """Per name: pretrained weights (or the model's seeded init) for the model's own
    parameters, the adapters' seeded init for what the steps added; with `model.adapter`, the
    adapters and the modules trained whole beside them from that adapter directory."""
    shapes = built.tp.global_shape if built.tp is not None else None
    source = spec.source(built.model, added=built.added, shapes=shapes)
    if built.added:
        names = {n for n, _ in built.model.named_parameters()} - set(built.added)
        if spec.cfg.adapter:
            from rayzero.models.lora import adapter_source, read_adapter

            saved = [n for n, p in built.model.named_parameters() if p.requires_grad and n not in built.added]
            start = adapter_source(read_adapter(spec.cfg.adapter, spec.storage_cfg), spec.storage_cfg,
                                   built.adapters, saved, whole_shapes(built.model, built.tp))
            names -= set(saved)
        else:
            from rayzero.models.lora import AdapterInit

            start = AdapterInit(built.model, spec.seed, built.adapters, shapes)
        source = PerName(source, names, start)
    return TPSlices(source, built.tp) if built.tp is not None else source  # each rank its slice


def assemble(cfg: RootConfig, spec: ModelSpec, mesh: Mesh, device: torch.device,
             streams: RandomStreams | None = None, frozen: bool = False, experts=None, resuming: bool = False):
    """Every step, on this rank: (the model, its strategy, where its initial values came from,
    its pipeline stages or None). `frozen`: every parameter frozen (a preference loss's
    reference model): the strategy holds them in the compute dtype, sharded as it shards
    frozen parameters, with no gradient, main copy or optimizer state. `experts`: the rank's
    `ExpertParallel` (its MoE layers' dispatch, whose loads the rank reports). `resuming`: a
    checkpoint is loaded over the trainable parameters next, so only the frozen ones get values
    (measured: a recovery's rendezvous at 8 ranks on 2 cores, 0.43-1.31 s with them, mostly 0.18-0.29 s without)."""
    built = build_model(cfg, spec, mesh, streams, compiled=True, experts=experts)
    if frozen:
        built.model.requires_grad_(False)
    # Where each parameter's values come from, matched on the whole model: pretrained weights
    # hold every stage's tensors, and a stage's model alone would leave the others' unclaimed.
    source = initial_values(spec, built)
    if resuming:
        frozen_names = {n for n, p in built.model.named_parameters() if not p.requires_grad}
        source = PerName(source, frozen_names, Zeros())
    check_buildable(cfg, device, spec, built.model)
    sharding = resolved_sharding(cfg, spec, built.model)  # ZeRO-3's unit classes: the whole model's
    pipeline_stage(built, cfg, spec, mesh)
    model = built.model
    if built.stages is not None and sharding.fsdp_units:  # a stage has only some of them
        present = set().union(*(class_names(m) for m in model.modules()))
        sharding = sharding.model_copy(update={"fsdp_units": tuple(c for c in sharding.fsdp_units if c in present)})
    for module in model.modules():  # buffers (RoPE frequencies, masks) are real: move them
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)
    tied = None
    if built.stages is not None:
        axis = tied_axis(mesh, built.stages)  # a collective: every rank makes every group
        tied = Tied(built.stages.tied, axis, counts=built.stages.first) if built.stages.tied else None
    strategy = build_strategy(sharding.strategy, model, mesh, sharding, cfg.optim, decays=spec.decays,
                              source=source, device=device, tp=built.tp, tied=tied, experts=spec.experts(model))
    if built.stages is not None:
        built.stages.set_dtype(strategy.precision.param)
    if built.compiled:  # every hook is in place now: those inside the compiled blocks run eagerly
        hooks_stay_eager(model, built.compiled)
    return model, strategy, source, built.stages


# -- what the driver checks before anything starts ------------------------------------------------

def bucket_layout(cfg: RootConfig, spec: ModelSpec, model: nn.Module) -> Layout:
    """The buckets the ranks will build for `model` (on the meta device is enough), on the
    device they will build them on (CPU without `cluster.use_gpu`)."""
    sharding = resolved_sharding(cfg, spec, model)
    return Strategy.layout(model, sharding, cfg.mesh().size("grad_reduce"), experts=spec.experts(model),
                           cpu=not cfg.cluster.use_gpu)[1]


def check_buildable(cfg: RootConfig, device: torch.device | None, spec: ModelSpec | None = None,
                    model: nn.Module | None = None, build: Callable[[], nn.Module] | None = None) -> None:
    """Raise a ValueError for a model/sharding combination that cannot train on `device`:
    FSDP unit classes or checkpointed blocks that match no module, a dtype the device cannot
    compute in (not checked with `device=None`: the driver of a GPU job may have no GPU).
    The model is built only where a check needs it (`build`: how, if the caller keeps one)."""
    sh = cfg.sharding
    if model is None and (sh.strategy == "optim_grads_params" or cfg.model.checkpoint_every or cfg.model.lora
                          or cfg.mesh().size("tp") > 1):
        spec = spec if spec is not None else make_spec(cfg)
        model = build() if build is not None else build_model(cfg, spec).model
    if sh.strategy == "optim_grads_params":
        find_units(model, fsdp_units(cfg, spec, model))
    for key in ("param_dtype", "grad_dtype", "comm_dtype"):
        name = getattr(sh, key)
        if name is not None and device is not None:
            try:
                check_device_supports(DTYPES[name], device)
            except ValueError as e:
                raise ValueError(f"sharding.{key}={name}: {e}") from None
