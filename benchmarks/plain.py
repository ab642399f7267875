"""What a user writes without rayzero: DDP or FSDP2 over the default process group, AdamW,
one training step at a time. The baselines of `vs_torchrun.py` (under torchrun) and of
`step_time.py` (in plain processes and inside Ray Train's `TorchTrainer`) all run this.

The same model (the GPT from `build_model` under the config's seed, or an HF model loaded by
`from_pretrained` from `model.path`), the same rows of every step's global batch
(`RankBatches` with dp_rank = this rank), AdamW with weight decay on matrices only, gradient
clipping and rayzero's learning-rate schedule. DDP all-reduces once per step (`no_sync()` on
every micro-batch but the last); FSDP2 is `fully_shard` on each transformer block (an HF
model's `_no_split_modules` class) and then on the root, and reduce-scatters on every
micro-batch, as rayzero's ZeRO-3 does.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from rayzero.cluster.schedule import lr_at
from rayzero.data.batches import RankBatches
from rayzero.data.tokens import TokenDataset
from rayzero.models.gpt import build_model


def alone(model):
    """No wrapper (`PlainTrainer(wrap=alone)`): each rank trains its own rows alone, nothing
    communicated, the whole model's AdamW step on every rank. The compute floor of data
    parallelism at a shape: what any strategy's step costs at least, running these kernels."""
    return model


def plain_model(cfg):
    """The model as a user builds it without rayzero, and its transformer blocks."""
    if cfg.model.kind == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
        units = set(model._no_split_modules)
        return model, [m for m in model.modules() if type(m).__name__ in units]
    model = build_model(cfg.model, cfg.block_size, cfg.train.seed)
    return model, list(model.blocks)


class PlainTrainer:
    """One rank of a plain DDP (or, `fsdp2`, FSDP2) run over the default process group.
    `wrap(model)` may replace DDP(model) (Ray Train's `prepare_model`)."""

    def __init__(self, cfg, data_path: str, fsdp2: bool = False, wrap=None):
        self.cfg, self.fsdp2 = cfg, fsdp2
        rank, world = dist.get_rank(), dist.get_world_size()
        self.model, blocks = plain_model(cfg)
        if fsdp2:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            self.mesh = init_device_mesh("cpu", (world,))
            for block in blocks:
                fully_shard(block, mesh=self.mesh)
            self.wrapped = fully_shard(self.model, mesh=self.mesh)
        else:
            self.wrapped = wrap(self.model) if wrap is not None else DDP(self.model)
        o = cfg.optim
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self.data = RankBatches(TokenDataset(data_path), seed=cfg.train.seed, global_batch=cfg.train.global_batch_size,
                                micro_batch=cfg.train.micro_batch_size, seq_len=cfg.train.seq_len, dp_rank=rank,
                                dp_size=world)
        # rayzero sums gradients over ranks of a loss divided by the global batch's tokens; DDP
        # averages them, so each rank's loss is scaled by the world size to give the same gradient.
        self.loss_scale = world / self.data.tokens_per_step

    def step(self, k: int) -> tuple[float, torch.Tensor]:
        """Iteration `k`: its wall time in seconds and this rank's summed loss."""
        t0 = time.perf_counter()
        cfg, o = self.cfg, self.cfg.optim
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(k, cfg.train.steps, o)
        micro = self.data.microbatches(k)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(micro):
            x, y = batch.tokens, batch.targets
            last = i == len(micro) - 1
            sync = (contextlib.nullcontext() if last or self.fsdp2 or self.wrapped is self.model
                    else self.wrapped.no_sync())
            with sync:
                out = self.wrapped(x)
                logits = getattr(out, "logits", out)  # an HF model's output object
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
                (loss * self.loss_scale).backward()
            loss_sum += loss.detach()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss_sum

    def run(self, steps: int) -> tuple[list[float], torch.Tensor]:
        """Iterations 0 .. steps-1: each one's wall time in seconds, and each one's mean loss
        over the global batch (reduced once, after the timed loop, so that no extra collective
        runs per step). Every rank must call it."""
        step_s, loss_sums = [], []
        for k in range(steps):
            dt, loss = self.step(k)
            step_s.append(dt)
            loss_sums.append(loss)
        losses = torch.stack(loss_sums)
        dist.all_reduce(losses)
        return step_s, losses / self.data.tokens_per_step

    def close(self) -> None:
        """Drop everything holding tensors or the mesh before the group goes: otherwise gloo's
        threads can still be running at interpreter exit and the process aborts."""
        self.wrapped = self.model = self.optimizer = self.mesh = None
        gc.collect()
