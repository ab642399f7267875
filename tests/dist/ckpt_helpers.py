"""Drive ranks through save / resume in plain processes, with the controller's committer."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.schedule import lr_at
from rayzero.config import load_config
from tests.conftest import free_port
from tests.dist.pool import spawn


def config(world: int, strategy: str, root: str, extra=()):
    return load_config(None, [
        f"cluster.num_workers={world}", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
        "model.bias=false", "train.seq_len=32", "train.global_batch_size=12", "train.micro_batch_size=1",
        "train.steps=20", "train.seed=3", f"sharding.strategy={strategy}", "sharding.bucket_numel=20000",
        "sharding.shard_align=1", "optim.lr=1e-3", "optim.warmup_steps=2", f"checkpoint.dir={root}",
        "checkpoint.every_steps=0", *extra,
    ])


def _rank(rank, world, cfg, data_path, port, first, last, save_at, resume, out):
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data_path)
    info = r.setup("127.0.0.1", port)
    if resume is not None:
        r.load_checkpoint(*resume)
        r.apply_checkpoint()
    ckpt = Checkpoints(cfg)
    results, losses = [], []
    for k in range(first, last):
        plan = {"step": k, "lr": lr_at(k, cfg.train.steps, cfg.optim)}
        if k + 1 == save_at:
            plan["checkpoint"] = {"uri": ckpt.root.child(f"step-{save_at:06d}").uri, "step": save_at}
        res = r.iteration(plan)
        losses.append((res["loss_sum"], res["tokens"]))
        if plan.get("checkpoint"):
            results.append((k, res))
    uploads = r.finish_checkpoints()
    state = r.full_state_dict()
    out[rank] = {"info": info, "results": results, "uploads": uploads, "losses": losses,
                 "state": state}
    r.close()


def run(cfg, data_path: str, first: int, last: int, save_at: int | None = None, resume=None) -> dict:
    """Steps [first, last) on `cfg.cluster.num_workers` ranks; commits a checkpoint after step
    `save_at` the way the controller does. Returns rank 0's state, the global losses, the commit."""
    world = cfg.cluster.num_workers
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_rank, args=(world, cfg, data_path, free_port(), first, last, save_at, resume, out), nprocs=world)
        out = {r: out[r] for r in range(world)}
    losses = [sum(out[r]["losses"][i][0] for r in range(world)) / sum(out[r]["losses"][i][1] for r in range(world))
              for i in range(last - first)]
    committed = None
    if save_at is not None:
        ckpt = Checkpoints(cfg)
        ckpt.configure([out[r]["info"] for r in range(world)], mlflow_run_id=None)
        (k, _), = out[0]["results"]
        ckpt.collect(k, [out[r]["results"][0][1] for r in range(world)])
        ckpt.add_uploads([u for r in range(world) for u in out[r]["uploads"]])
        committed = ckpt.last_committed
    return {"state": out[0]["state"], "losses": losses, "committed": committed,
            "infos": [out[r]["info"] for r in range(world)]}
