"""The vocabulary split over the TP ranks on real gloo groups: the cross-entropy on logit shards
equals torch's on the whole logits (value and gradient, ignored targets, a vocabulary the TP size
does not divide), and so does the entropy of its softmax; through a rank's real iterations no tensor of the full vocabulary's width
exists anywhere, forward, backward or step."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from rayzero.sharding.comm import Axis
from rayzero.sharding.vocab_parallel import VocabShard
from rayzero.workers.rank import Rank
from tests.conftest import free_port
from tests.dist.pool import spawn
from tests.models import save_hf_model


def _cross_entropy(rank: int, world: int, vocab: int, dtype, port: int, out: dict):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(3, 5, vocab, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    targets[0, :2] = -100
    shard = VocabShard(Axis(dist.group.WORLD, world, rank), vocab)
    mine = torch.full((3, 5, shard.rows), 7.0, dtype=dtype)  # padding rows: any value, never in the loss
    mine[..., :shard.real] = whole[..., shard.start: shard.start + shard.real]
    mine.requires_grad_(True)
    loss, count = shard.token_loss(mine, targets)
    loss.backward()
    out[rank] = {"loss": loss.detach(), "count": int(count), "grad": mine.grad[..., :shard.real].clone(),
                 "pad_grad": mine.grad[..., shard.real:].clone(), "dtype": mine.grad.dtype,
                 "entropy": shard.entropy(mine.detach() / 0.7)}


@pytest.mark.parametrize("world, vocab, dtype", [(2, 7, torch.float32), (4, 7, torch.float32), (2, 11, torch.bfloat16)])
def test_the_loss_on_shards_is_torchs_on_the_whole_logits(world, vocab, dtype):
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(3, 5, vocab, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    targets[0, :2] = -100
    ref = F.cross_entropy(whole.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    ref.backward()
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_cross_entropy, args=(world, vocab, dtype, free_port(), out), nprocs=world)
        out = dict(out)
    rows = -(-vocab // world)
    for r in range(world):
        assert out[r]["loss"].item() == pytest.approx(ref.item(), rel=1e-6) and out[r]["count"] == 13
        lo, hi = r * rows, min(vocab, (r + 1) * rows)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(out[r]["grad"].float(), whole.grad[..., lo:hi].float(), atol=tol), r
        assert out[r]["dtype"] == dtype and not out[r]["pad_grad"].any(), "padding rows get no gradient"
        logps = torch.log_softmax((whole.detach() / 0.7).float(), -1)  # GRPO's entropy at a sampling temperature
        assert torch.allclose(out[r]["entropy"], -(logps.exp() * logps).sum(-1), rtol=1e-5, atol=1e-6), r


class WidestTensors(TorchDispatchMode):
    """Every tensor an op produces: the largest size of any dimension of a tensor of two or more
    dimensions (a 1-D flat bucket is no logits), and the last dimension of the logits the loss sees."""

    def __init__(self):
        super().__init__()
        self.widest, self.logit_widths = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.widest = max(self.widest, max(t.shape))
        if func is torch.ops.aten.amax.default:  # the loss's row maximum: over the logits it sees
            self.logit_widths.add(args[0].shape[-1])
        return out


def _widest(rank: int, cfg, data_path: str, port: int, out: dict):
    torch.set_num_threads(1)
    r = Rank(cfg, rank, cfg.cluster.num_workers, data_path)
    r.setup("127.0.0.1", port)
    spy = WidestTensors()
    with spy:
        for step in range(2):
            r.iteration({"step": step, "lr": lr_at(step, 2, cfg.optim)})
    out[rank] = {"widest": spy.widest, "logits": sorted(spy.logit_widths)}
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "llama-untied"])
def test_no_rank_ever_holds_the_full_vocabularys_logits(name, tmp_path, small_dataset):
    """tp 2 x dp 2 under ZeRO-3 with a 1,031-token vocabulary (wider than any other dimension
    of these models): two training iterations on every rank, every tensor any op makes looked
    at; none is as wide as the vocabulary, and the loss sees logits of ceil(V / 2) = 516."""
    vocab = 1031
    if name == "gpt":
        keys = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", f"model.vocab_size={vocab}"]
    else:
        keys = ["model.kind=hf", f"model.path={save_hf_model(name, tmp_path / 'm', vocab_size=vocab)}"]
    cfg = load_config(None, ["cluster.num_workers=4", "parallel.tp=2", "sharding.strategy=optim_grads_params",
                             "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1", *keys])
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_widest, args=(cfg, small_dataset, free_port(), out), nprocs=4)
        out = dict(out)
    for rank in range(4):
        assert out[rank]["logits"] == [516], (rank, out[rank])
        assert out[rank]["widest"] < vocab, (rank, out[rank])
