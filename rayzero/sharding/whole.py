"""A strategy's weights whole, outside the iteration: bucket by bucket (`whole_buckets`), so that
only one bucket is whole on the device at a time, for the final weights (`full_state_dict`) and
for the rollout actors' weight syncs. Every rank goes through them: they are collectives."""

from __future__ import annotations

import torch

from rayzero.sharding.comm import wait
from rayzero.sharding.tensor_parallel import gather_global


def full_state_dict(strategy) -> dict[str, torch.Tensor]:
    """The fp32 main parameters, whole, on CPU, by `model.state_dict()` names. Every rank must call it (owned
    pieces are summed into place across the owner axis); bucket by bucket (`whole_buckets`), so only one
    bucket is ever whole on the device."""
    merged: dict[str, torch.Tensor] = {}
    for part in whole_buckets(strategy):
        merged.update(part)
    return {key: merged[key] for key in strategy.model.state_dict(keep_vars=True)}


def whole_buckets(strategy, trainable_only: bool = False):
    """The model's weights, whole (fp32, on CPU, tensor-parallel shards gathered), one bucket at a time:
    {`model.state_dict()` name: tensor} per bucket, then the buffers, which every rank holds whole (a tied
    weight under each of its names, as separate tensors: file formats refuse shared storage).
    `trainable_only`: the trainable buckets alone (what changes at a step). A collective: every rank must go
    through it to the end, each in the same order; only one bucket is whole at a time."""
    strategy.finish_param_sync()
    name_of = {id(p): n for n, p in zip(strategy.buffer.names, strategy.buffer.params)}
    keys_of: dict[str, list[str]] = {}
    buffers: dict[str, torch.Tensor] = {}
    for key, v in strategy.model.state_dict(keep_vars=True).items():
        if id(v) in name_of:
            keys_of.setdefault(name_of[id(v)], []).append(key)
        else:  # a buffer, not a parameter: every rank holds it whole
            buffers[key] = v
    for b, main in zip(strategy.buffer.buckets, strategy.main_params):
        trainable = strategy.buffer.trainable(b)
        if trainable_only and not trainable:
            continue
        if trainable:
            full = torch.zeros(b.world.size, dtype=torch.float32, device=strategy.buffer.device)
            full[b.local(strategy.owned(b))] = main
            axis = strategy._of[b.index].owner.axis
            if axis is not None:
                wait(axis.start_all_reduce(full))
        else:  # frozen: no main copy, the compute parameters are the values
            full = strategy._of[b.index].placement.whole(b).float()
        by_name: dict[str, torch.Tensor] = {}
        for i in b.params:
            span = strategy.buffer.layout.params[i].world
            by_name[strategy.buffer.names[i]] = full[b.local(span)].view(strategy.buffer.params[i].shape).cpu().clone()
        del full
        if strategy.tp is not None:  # the TP ranks' shards, whole (every rank of the group in one order)
            for name in sorted(n for n in by_name if n in strategy.tp.split):
                by_name[name] = gather_global(name, by_name[name], strategy.tp,
                                              strategy.mesh.axis(strategy.tp.split[name].axis))
        out = {}
        for name, t in by_name.items():
            for j, key in enumerate(keys_of.get(name, ())):
                out[key] = t if j == 0 else t.clone()
        yield out
    if buffers and not trainable_only:
        yield {k: v.detach().cpu().clone() for k, v in buffers.items()}
