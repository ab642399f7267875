"""What each rank of a generated configuration runs (tests/dist/test_combinations.py), in a module
of its own: the kept rank processes import it to run a job, and importing the test module would
generate the configurations again in each of them (the pairwise search, about a second)."""

from __future__ import annotations

import torch

from rayzero.checkpoint.manifest import open_checkpoint
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.schedule import lr_at
from tests.combinations import SAVE_AT, STEPS


def _train(rank: int, world: int, cfg, data: str, port: int, rollouts: list | None, out: dict):
    """3 steps as the actors run them; with a checkpoint directory, one saved after step 2.
    `rollouts`: each step's, as the driver puts them in its plan (online RL)."""
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data)
    info = r.setup("127.0.0.1", port)
    initial = r.full_state_dict()
    ckpt = Checkpoints(cfg) if cfg.checkpoint.dir else None
    pipe, steps, saved, uploads, sent = r._pipe, [], None, [], 0
    for k in range(STEPS):
        plan = {"step": k, "lr": lr_at(k, STEPS, cfg.optim), **({"rollout": rollouts[k]} if rollouts else {})}
        if ckpt is not None and k + 1 == SAVE_AT:
            plan["checkpoint"] = {"uri": ckpt.root.child(f"step-{SAVE_AT:06d}").uri, "step": SAVE_AT}
        if pipe is not None and k == STEPS - 1:
            pipe.trace, sent = [], pipe.link.sent_bytes  # the last step's, for the test to read
        res = r.iteration(plan)
        uploads += res["uploads"]
        saved = res if plan.get("checkpoint") else saved
        steps.append({**{key: res.get(key) for key in ("loss_sum", "tokens", "grad_norm", "aux_loss_sum", "z_loss_sum",
                                                       "objective")}, "compile_s": res["phase_s"].get("torch_compile")})
    uploads += r.finish_checkpoints()
    grads = {n for n, p in r.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    out[rank] = {"info": info, "steps": steps, "initial": initial, "state": r.full_state_dict(),
                 "memory": res["memory"], "grads": grads, "saved": saved, "uploads": uploads,
                 "trace": [a for a, _, _ in pipe.trace] if pipe is not None else [],
                 "sent": pipe.link.sent_bytes - sent if pipe is not None else 0}
    del pipe  # before `close`, which releases what the rank built: nothing here may hold it then
    r.close()


def _resume(rank: int, world: int, cfg, data: str, port: int, where: str, rollouts: list | None, out: dict):
    """A new group resumes the committed checkpoint and trains the steps after it, set up as the
    controller sets up a group rebuilt after a commit (`resuming`: its trainable weights zero
    until the load brings them, its frozen ones read as always)."""
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data)
    r.setup("127.0.0.1", port, resuming=True)
    zero = all(not m.any() for m in r.strategy.main_params)
    c = open_checkpoint(where)
    r.load_checkpoint(c.uri, c.manifest)
    r.apply_checkpoint()
    steps = [r.iteration({"step": k, "lr": lr_at(k, STEPS, cfg.optim), **({"rollout": rollouts[k]} if rollouts else {})})
             for k in range(SAVE_AT, STEPS)]
    out[rank] = {"state": r.full_state_dict(), "losses": [(s["loss_sum"], s["tokens"]) for s in steps],
                 "zero_before_load": zero}
    r.close()
