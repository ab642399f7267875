"""gloo's reduce-scatter and all-gather as `Axis` does them, point to point, on real groups: the
sums of each rank's chunk in rank order, bit for bit; several started before any is waited for
(a strategy keeps buckets in flight) each landing where it belongs; a gather into a separate
tensor and one in place; and on a subgroup, whose peers' global ranks are not their indices."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayzero.sharding.comm import Axis, wait
from tests.conftest import free_port
from tests.dist.pool import spawn


def _inputs(world: int, n: int, dtype) -> list[list[torch.Tensor]]:
    """Every rank's full buckets (three of them, of different sizes): the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(n * world * (b + 1), generator=g).to(dtype) for b in range(3)] for _ in range(world)]


def _exchanges(rank: int, world: int, n: int, dtype, port: int, out: dict):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sub = dist.new_group(list(range(1, world)))  # every rank makes it; ranks 1.. use it
    try:
        axis = Axis(dist.group.WORLD, world, rank)
        fulls = [t.clone() for t in _inputs(world, n, dtype)[rank]]
        works = [axis.start_reduce_scatter(f) for f in fulls]  # all in flight at once
        for w in works[::-1]:
            w.wait()
        sums = [axis.chunk(f).clone() for f in fulls]
        # gathers: into a separate tensor, and in place (the local shard is the full's chunk)
        shards = [torch.full((n * (b + 1),), float(10 * rank + b), dtype=dtype) for b in range(3)]
        apart = [torch.empty(n * (b + 1) * world, dtype=dtype) for b in range(3)]
        inplace = [torch.empty(n * (b + 1) * world, dtype=dtype) for b in range(3)]
        for b in range(3):
            axis.chunk(inplace[b]).copy_(shards[b])
        works = [axis.start_all_gather(apart[b], shards[b]) for b in range(3)]
        works += [axis.start_all_gather(inplace[b], axis.chunk(inplace[b])) for b in range(3)]
        for w in works:
            w.wait()
        result = {"sums": sums, "apart": apart, "inplace": inplace}
        if rank > 0:
            on_sub = Axis(sub, world - 1, rank - 1)
            full = torch.arange(2 * (world - 1), dtype=dtype) * rank
            wait(on_sub.start_reduce_scatter(full))  # a group of one (world 2): nothing to send
            result["sub"] = on_sub.chunk(full).clone()
        out[rank] = result
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, dtype", [(3, torch.float32), (2, torch.bfloat16)])
def test_point_to_point_reduce_scatter_and_all_gather(world, dtype):
    n = 5
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_exchanges, args=(world, n, dtype, free_port(), out), nprocs=world)
        out = dict(out)
    inputs = _inputs(world, n, dtype)
    for r in range(world):
        for b in range(3):
            size = n * (b + 1)
            expected = inputs[0][b][r * size:(r + 1) * size].clone()
            for j in range(1, world):  # in rank order, as every rank sums its chunk
                expected += inputs[j][b][r * size:(r + 1) * size]
            assert torch.equal(out[r]["sums"][b], expected), (r, b)
            gathered = torch.cat([torch.full((size,), float(10 * j + b), dtype=dtype) for j in range(world)])
            assert torch.equal(out[r]["apart"][b], gathered) and torch.equal(out[r]["inplace"][b], gathered), (r, b)
    for r in range(1, world):  # the subgroup of ranks 1..: index r - 1, its chunk of 2
        k = r - 1
        expected = sum(torch.arange(2 * (world - 1), dtype=dtype)[2 * k:2 * k + 2] * j for j in range(1, world))
        assert torch.equal(out[r]["sub"], expected), r
