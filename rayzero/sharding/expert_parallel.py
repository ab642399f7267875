"""Expert parallelism's token dispatch: a mixture of experts' experts split over the ranks of an
`ep` group, and each token sent to the ranks holding the experts its router chose.

Each rank of the group holds E/ep consecutive experts (rank r: experts r·E/ep … (r+1)·E/ep − 1)
and routes its own tokens. For one MoE layer (`dispatch`):

    1. route      the router's top-k choices flattened to (token, choice) pairs, sorted by expert
                  (stable: within an expert, in token order)
    2. capacity   optional (`capacity_factor`): an expert takes at most
                  ceil(factor · pairs / E) of this rank's pairs, the first in token order; the
                  rest are dropped (counted, and their share of the output is zero)
    3. counts     an all-to-all of the pair counts: every rank learns how many pairs each other
                  rank sends to each of its experts (the token exchange's uneven splits)
    4. tokens     an all-to-all of the pairs' hidden states, each rank's to the experts' ranks
    5. experts    the received pairs regrouped by local expert, and the experts run on them
                  (`experts(x, counts)`: a loop over the local experts, or a grouped matmul)
    6. back       the reverse all-to-all returns each pair's expert output to its token's rank,
                  which weights it by the router's probability and adds it into the token's row

Backward is the mirror image: the all-to-alls' gradients are the reverse all-to-alls
(torch's `all_to_all_single_autograd`), and the sorts and regroupings are index
operations autograd inverts. Nothing here knows a model family: `experts` is the family's own
arithmetic on this rank's experts (the model seam provides it).

Each dispatch returns its `Load` (pairs per expert, pairs dropped, bytes this rank sent), which
`ExpertParallel` gathers into the step's metrics. The dispatch reads the device once (the
exchanged counts, which the token exchange's splits need); the rest stays on the device.

Pure torch, no Ray: the ep group is an `Axis` (`comm.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class Load:
    """One dispatch's routing: pairs per expert (over the whole group, every expert), and pairs
    this rank dropped."""

    per_expert: torch.Tensor  # [E], int64, summed over the ep group
    dropped: int = 0
    sent_bytes: int = 0  # to the other ranks: the tokens out and the results back


def local_experts(num_experts: int, ep: int, rank: int) -> range:
    """The experts rank `rank` of `ep` holds."""
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over ep {ep}")
    n = num_experts // ep
    return range(rank * n, (rank + 1) * n)


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], axis) -> torch.Tensor:
    """`x`'s rows, `send[j]` of them to rank j in order, and the rows every rank sends here,
    `recv[j]` from rank j; differentiable (its gradient goes back the reverse way)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), recv, send, axis.group))


def capacity(pairs: int, num_experts: int, factor: float) -> int:
    """The most pairs an expert takes from one rank at `factor` (Switch's ceil(f · pairs / E))."""
    return math.ceil(factor * pairs / num_experts)


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             experts: Callable[[torch.Tensor, list[int]], torch.Tensor], axis, num_experts: int,
             capacity_factor: float | None = None) -> tuple[torch.Tensor, Load]:
    """The MoE layer's output for this rank's tokens (see the module docstring): `hidden` [N, H],
    `top_k_index`, `top_k_weights` [N, k] (the router's experts and weights), `experts(x,
    counts)`: this rank's experts on `x`, its rows grouped by local expert, `counts[e]` rows for
    local expert e, returning [rows, H]; `axis`: the ep group. Also the routing's `Load`."""
    n, k = top_k_index.shape
    ep, rank = axis.size, axis.rank
    per_rank = num_experts // ep
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the pairs by expert, each expert's in token order
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity_factor is not None:
        cap = capacity(n * k, num_experts, capacity_factor)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(order.numel(), device=flat.device) - starts[flat[order]]
        order = order[rank_in_expert < cap]
        counts = counts.clamp(max=cap)
    token = order // k  # each kept pair's token, in expert order
    # 3. counts: what each rank sends to each expert, exchanged so each rank knows what it gets
    send_counts = counts.view(ep, per_rank)
    got_counts = torch.empty_like(send_counts)
    if ep > 1:
        dist.all_to_all_single(got_counts, send_counts.contiguous(), group=axis.group)
    else:
        got_counts.copy_(send_counts)
    host_send, host_got = send_counts.tolist(), got_counts.tolist()  # the splits: one read from the device
    send = [sum(row) for row in host_send]
    recv = [sum(row) for row in host_got]
    # 4. tokens out
    x = hidden.index_select(0, token)
    x = _exchange(x, send, recv, axis) if ep > 1 else x
    # 5. regroup by local expert: received in (source rank, expert) blocks, the experts want
    # (expert, source rank): each row's block, sorted by (expert, source), stable
    block = torch.repeat_interleave(torch.arange(ep * per_rank, device=hidden.device), got_counts.reshape(-1),
                                    output_size=sum(recv))
    regroup = torch.argsort((block % per_rank) * ep + block // per_rank, stable=True)
    y = experts(x.index_select(0, regroup), [sum(col) for col in zip(*host_got)])
    y = y.index_select(0, torch.argsort(regroup))  # back to (source rank, expert) order
    # 6. back to the tokens' ranks, weighted, added into their rows
    y = _exchange(y, recv, send, axis) if ep > 1 else y
    weights = top_k_weights.reshape(-1).index_select(0, order)
    out = torch.zeros_like(hidden)
    out = out.index_add(0, token, (y * weights.unsqueeze(-1)).to(out.dtype))
    per_expert = counts.clone()
    if ep > 1:
        dist.all_reduce(per_expert, group=axis.group)
    row = hidden.shape[-1] * hidden.element_size()  # the tokens out, their results back
    sent = (sum(send) - send[rank] + sum(recv) - recv[rank]) * row if ep > 1 else 0
    dropped = n * k - sum(send)  # what capacity left out (0 dropless)
    return out, Load(per_expert, dropped, sent)


@dataclass
class ExpertParallel:
    """What the model seam installs: this rank's place in its ep group (`axis`, the mesh's `ep`
    role) and the routing options; every MoE layer's dispatch goes through `run`, which keeps
    the step's loads for the metrics (`take_loads`)."""

    axis: object
    capacity_factor: float | None = None
    grouped_mm: bool = True  # the local experts in one grouped matmul where torch has one for the device
    compiled: bool = False  # the blocks are compiled (`train.compile`): `run` is called as eager code
    loads: list[Load] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.axis.size

    @property
    def rank(self) -> int:
        return self.axis.rank

    def experts(self, num_experts: int) -> range:
        """The experts this rank holds, of `num_experts`."""
        return local_experts(num_experts, self.axis.size, self.axis.rank)

    @classmethod
    def from_config(cls, axis, cfg) -> ExpertParallel:
        """The dispatch over `axis` (the `ep` role) as the run's config `cfg` sets it up."""
        return cls(axis, cfg.moe.capacity_factor, cfg.moe.grouped_mm, cfg.train.compile)

    def __post_init__(self):
        if self.compiled:  # torch.compiler imports dynamo: only where the blocks compile anyway
            self.run = torch.compiler.disable(self.run)

    def run(self, hidden, top_k_index, top_k_weights, experts, num_experts: int) -> torch.Tensor:
        """One MoE layer's dispatch (`dispatch`). With `compiled` blocks it runs eagerly, between
        the compiled pieces before and after it: its splits are read from the device and differ
        from call to call. Traced, they recompiled the block at every layer of the first step
        (26 s of it at ep 2, a 4-layer Mixtral) until dynamo gave up on it, or broke its tracing."""
        out, load = dispatch(hidden, top_k_index, top_k_weights, experts, self.axis, num_experts,
                             self.capacity_factor)
        if torch.is_grad_enabled() and torch._C._current_autograd_node() is None:  # training's forwards, not
            self.loads.append(load)  # evaluation's (no gradient) nor a recompute's (inside backward)
        return out

    def take_loads(self) -> dict[str, float]:
        """The loads since the last call, as the step's metrics: the busiest expert's pairs over
        the mean (1.0: even; the most and the mean over the layers' forwards), pairs dropped by
        capacity, and the bytes this rank's forwards sent to the other ranks (tokens out,
        results back)."""
        loads, self.loads = self.loads, []
        if not loads:
            return {}
        per = torch.stack([x.per_expert for x in loads]).float()  # [forwards, E]: one read from the device
        ratios = (per.max(1).values / per.mean(1).clamp(min=1e-9)).tolist()
        return {"expert_load_max_over_mean": max(ratios), "expert_load_mean_max_over_mean": sum(ratios) / len(ratios),
                "dropped_pairs": float(sum(x.dropped for x in loads)),
                "alltoall_bytes": float(sum(x.sent_bytes for x in loads))}

