"""Dropout masks on real gloo groups, as a rank's real iteration draws them (`sharding/rng.py`):
at tp 2 and tp 4 the TP ranks draw different masks where they hold different activations
(their attention heads; with sequence parallelism, their sequence shards) and the same masks
where they hold the same ones (the embeddings' output, the residual stream); data-parallel ranks
draw different masks; a recompute under activation checkpointing draws exactly the masks of the
first forward. Every mask dropout draws is recorded, with the stream that drew it, by a dispatch
mode that only looks."""

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from rayzero.config import load_config
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist.pool import spawn

pytestmark = pytest.mark.slow

HEADS, EMBD, SEQ, MICRO = 4, 64, 32, 1


class Masks(TorchDispatchMode):
    """Each Bernoulli draw (dropout's mask; SDPA's attention dropout included): (the stream that
    drew it, its shape, the mask), in order, split into forward and backward (recompute) draws."""

    def __init__(self, streams):
        super().__init__()
        self.streams, self.forward, self.backward, self.phase = streams, [], [], "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli.default, torch.ops.aten.bernoulli.p):
            getattr(self, self.phase).append((self.streams.active, tuple(out.shape), out.bool().clone()))
        return out


def _draws(rank: int, cfg, data_path: str, port: int, out: dict):
    torch.set_num_threads(1)
    r = Rank(cfg, rank, cfg.cluster.num_workers, data_path)
    r.setup("127.0.0.1", port)
    r.gather({"step": 3, "lr": 1e-3})
    spy = Masks(r.streams)
    with spy:
        prev = r.forward({})
        spy.phase = "backward"
        r.backward(prev)
    out[rank] = {"forward": spy.forward, "backward": spy.backward, "tp_rank": r.mesh.coord("tp"), "dp_rank": r.mesh.coord("batch")}
    r.close()


@pytest.mark.parametrize("tp, sp, recompute", [(2, False, "none"), (4, False, "full"), (2, True, "full")])
def test_tp_ranks_draw_alike_where_they_hold_alike_and_apart_where_they_do_not(tp, sp, recompute, small_dataset):
    cfg = load_config(None, ["cluster.num_workers=4", f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}",
                             f"model.n_head={HEADS}", f"model.n_embd={EMBD}", "model.n_layer=2", "model.dropout=0.1",
                             f"train.seq_len={SEQ}", "train.global_batch_size=4", f"train.micro_batch_size={MICRO}",
                             f"model.activation_checkpointing={recompute}"])
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_draws, args=(cfg, small_dataset, free_port(), out), nprocs=4)
        out = dict(out)
    groups = [[r for r in range(4) if out[r]["dp_rank"] == d] for d in range(4 // tp)]
    whole, shard = (MICRO, SEQ, EMBD), (MICRO, SEQ // tp, EMBD)
    attention = (MICRO, HEADS // tp, SEQ, SEQ)  # a rank's heads
    for group in groups:
        draws = [out[r]["forward"] for r in group]
        regions = [[(region, shape) for region, shape, _ in d] for d in draws]
        assert all(x == regions[0] for x in regions), "the TP ranks draw in the same places"
        # where each draw is: the embeddings' output whole and common; per block the attention
        # heads in the rank's own stream, the MLP's residual dropout common (or, with sequence
        # parallelism, on the rank's sequence shard in its own stream)
        residual = ("sequence", shard) if sp else ("replicated", whole)
        assert regions[0] == [("replicated", whole)] + [("tp", attention), residual] * 2, regions[0]
        for i, (region, _) in enumerate(regions[0]):
            masks = [d[i][2] for d in draws]
            if region == "replicated":
                assert all(torch.equal(m, masks[0]) for m in masks), (i, region)
            else:
                assert all(not torch.equal(a, b) for j, a in enumerate(masks) for b in masks[j + 1:]), (i, region)
    if len(groups) > 1:  # data-parallel ranks: other rows, other masks
        a, b = out[groups[0][0]]["forward"], out[groups[1][0]]["forward"]
        assert all(not torch.equal(x[2], y[2]) for x, y in zip(a, b))
    for r in range(4):
        back = out[r]["backward"]
        if recompute == "none":
            assert back == []
            continue
        # the recompute (blocks in reverse order) draws exactly what the first forward drew
        blocks = out[r]["forward"][1:]
        redrawn = back[2:] + back[:2]
        assert len(redrawn) == len(blocks)
        assert all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(redrawn, blocks)), r
