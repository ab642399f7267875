"""Pipeline parallelism before the cluster starts: the checks that refuse sizes or models it
cannot run (each said once, in the config's terms), and the dry run's view of the stages: which
ranks hold which stage and blocks, and the memory of each."""

from __future__ import annotations

import torch.nn as nn

from rayzero.config import RootConfig
from rayzero.pipeline import schedules
from rayzero.pipeline.stages import StagePlan, stage_names
from rayzero.workers.assembly import stage_plan


def check_pipeline(cfg: RootConfig, spec, model: nn.Module) -> StagePlan | None:
    """The stage split of `model` (the whole, on the meta device) for `parallel.pp`, or None
    without a pipeline; ValueError (PipelineError, ModelError) for what cannot run."""
    p = cfg.parallel
    if p.pp == 1:
        return None
    problem = schedules.check(p.pp_schedule, p.pp, cfg.grad_accum, p.pp_virtual_stages)
    if problem:
        raise ValueError(f"parallel.pp_schedule: {problem}")
    if p.pp_schedule == "zero_bubble" and cfg.sharding.strategy == "optim_grads_params":
        raise ValueError("parallel.pp_schedule: zero_bubble runs each micro-batch's weight gradients apart from its "
                         "backward, after ZeRO-3 has released the units they need (sharding.strategy="
                         "optim_grads_params); use 1f1b or interleaved_1f1b with ZeRO-3, or zero_bubble with "
                         "optim_grads")
    if p.pp_schedule == "zero_bubble" and cfg.model.activation_checkpointing == "selective":
        # torch's selective checkpoint frees what it saved at the first backward through a block
        raise ValueError("parallel.pp_schedule: zero_bubble runs each block's backward twice (its input gradients, "
                         "then its weight gradients), and selective activation checkpointing allows one; use "
                         "model.activation_checkpointing=full or every:N with zero_bubble, or 1f1b")
    if spec.aux_coef and spec.routers(model) is None:
        raise ValueError(f"parallel.pp: {spec.where}'s auxiliary loss is computed over the whole model, and rayzero "
                         "does not know how to gather its inputs across stages; set parallel.pp=1")
    plan = stage_plan(cfg, spec, model)
    if not plan.first:
        raise ValueError(f"parallel.pp: {type(model).__name__} has no input embedding before its first block, so "
                         "the width of what passes between stages is unknown")
    return plan


def pipeline_plan(cfg: RootConfig, plan: StagePlan, model: nn.Module, per_param: float, frozen_per_param: float,
                  activations: int | None) -> dict:
    """Each pipeline rank's stages, ranks, blocks, parameters and memory per rank (the model
    state by Megatron's formula; activations: one micro-batch's times the most the schedule
    holds at once)."""
    mesh = cfg.mesh()
    p, v, m = plan.pp, plan.virtual, cfg.grad_accum
    sim = schedules.simulate(schedules.schedule(cfg.parallel.pp_schedule, p, m, v))
    names = stage_names(model, plan)
    params = dict(model.named_parameters())
    ranks = {r: [] for r in range(p)}
    for g in mesh.groups("pp"):
        for r, rank in enumerate(g):
            ranks[r].append(rank)
    out = []
    for r in range(p):
        stages = plan.stages_of(r)
        held = set().union(*(names[s] for s in stages))
        trainable = sum(params[n].numel() for n in held if params[n].requires_grad)
        frozen = sum(params[n].numel() for n in held if not params[n].requires_grad)
        state = int(per_param * trainable + frozen_per_param * frozen)
        # one chunk's forward saves about its share of the blocks' activations
        share = sum(plan.counts[s] for s in stages) / len(plan.blocks) / v
        in_flight = sim.peak_in_flight(r)
        act = int(activations * share * in_flight) if activations is not None else None
        out.append({"pp_rank": r, "ranks": sorted(ranks[r]), "stages": stages,
                    "modules": [plan.describe()[s] for s in stages], "params": trainable + frozen,
                    "bytes_per_rank": state, "in_flight": in_flight, "activations_bytes": act})
    return {"pp": p, "schedule": cfg.parallel.pp_schedule, "virtual": v, "micro_batches": m,
            "bubble": schedules.bubble_formula(cfg.parallel.pp_schedule, p, m, v), "ranks": out}


def pipeline_lines(pp: dict) -> list[str]:
    """The dry run's lines for the pipeline."""
    lines = [f"pipeline: {pp['pp']} stages" + (f" x {pp['virtual']} chunks" if pp["virtual"] > 1 else "")
             + f", schedule {pp['schedule']}, {pp['micro_batches']} micro-batches a step: bubble "
             f"{pp['bubble']:.1%} of the compute (the schedule's formula)"]
    for r in pp["ranks"]:
        held = f"{r['in_flight']} micro-batch{'es' if r['in_flight'] > 1 else ''} in flight"
        act = (f" + activations {r['activations_bytes'] / 2**20:,.1f} MiB ({held})"
               if r["activations_bytes"] is not None else f", {held}")
        lines.append(f"  pp rank {r['pp_rank']} (ranks {', '.join(map(str, r['ranks']))}): "
                     + "; ".join(r["modules"]) + f"; {r['params']:,} parameters, model state "
                     f"{r['bytes_per_rank'] / 2**20:,.1f} MiB per rank{act}")
    return lines
