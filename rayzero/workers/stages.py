"""A rank's side of pipeline parallelism beyond one iteration's schedule (`pipeline/runner.py`):
its pipeline made from the config and mesh, the whole model's weights gathered from its stages,
and what its setup reports about them."""

from __future__ import annotations

import torch.distributed as dist

from rayzero.pipeline.runner import Link, PipeContext, PipelineRun
from rayzero.pipeline.schedules import place_of, schedule
from rayzero.pipeline.stages import Stages


def start_pipeline(cfg, spec, model, strategy, stages: Stages, mesh, device, streams, meter, vocab) -> PipelineRun:
    """This rank's pipeline: its schedule's actions and its peers on the pipeline group."""
    p, v = mesh.size("pp"), cfg.parallel.pp_virtual_stages
    m = cfg.grad_accum_for(mesh)
    actions = schedule(cfg.parallel.pp_schedule, p, m, v)[mesh.coord("pp")]
    coords = mesh.coords(mesh.rank)
    peers = [mesh.rank_at({**coords, "pp": place_of(s, p)[0]}) for s in range(stages.plan.num_stages)]
    shape = boundary_shape(cfg, stages, mesh)
    return PipelineRun(PipeContext(
        model, spec, strategy, stages, Link(stages, peers, shape[1]), actions, shape=shape, dtype=strategy.precision.param, device=device, streams=streams,
        meter=meter, vocab=vocab, routers=stages.routers))


def boundary_shape(cfg, stages: Stages, mesh) -> tuple[int, int, int]:
    """What passes between stages: (micro-batch, sequence, hidden): a cp rank's part of the
    sequence, and its shard over the `tp` role with sequence parallelism, whose activations are split along it between the
    blocks; the hidden width from the model's input embedding (the model seam's stage plan)."""
    if not stages.absent:
        raise ValueError("parallel.pp: the model has no input embedding before its first block, so the width "
                         "of the activations passed between stages is unknown")
    seq = cfg.train.seq_len // mesh.size("cp") // (mesh.size("tp") if cfg.parallel.sequence_parallel else 1)
    return cfg.train.micro_batch_size, seq, stages.absent[0].dim


def whole_state_dict(state: dict | None, mesh) -> dict | None:
    """The whole model's weights on rank 0 from each stage's (`state`: the stage's, on the
    stage's first rank; None elsewhere): gathered over the pipeline group of rank 0, the first
    stage's copy of a tied weight kept. Every rank must call it."""
    pp = mesh.axis("pp")
    group = mesh.my_group("pp")
    gathered = [None] * pp.size if mesh.rank == group[0] else None
    dist.gather_object(state, gathered, dst=group[0], group=pp.group)
    if mesh.rank != 0:
        return None
    out: dict = {}
    for part in gathered:
        for k, v in (part or {}).items():
            out.setdefault(k, v)
    return out


def stage_report(spec, model, stages: Stages, seq_len: int) -> dict:
    """What setup reports of this rank's stages: their modules, and the training FLOPs per token
    of its part of the model (attention's term for its blocks only)."""
    plan = stages.plan
    flops = spec.flops_per_token(model, seq_len)
    shape = spec.attention_shape(model)
    if shape is not None:
        held = sum(plan.counts[s] for s in stages.chunks)
        layers, width = shape
        flops -= 12.0 * (layers - held * layers / len(plan.blocks)) * width * seq_len
    return {"stages": list(stages.chunks), "layers": [plan.describe()[s] for s in stages.chunks],
            "flops_per_token": flops}
