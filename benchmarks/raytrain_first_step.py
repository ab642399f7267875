"""The Ray Train baseline of `startup.py`: what a Ray Train user's script does before its first
step, with rayzero's GPT, starting a local Ray of its own.

A `TorchTrainer` of `WORLD` CPU workers (no `ray.init()` in the script: the trainer starts the
local Ray, as a user's first script does), whose training function builds the same model
(`rayzero/models/gpt.py`, the config's preset and seed) on every worker, wraps it with
`prepare_model` (DDP over gloo), and takes one optimizer step of the config's global batch split
over the workers, in micro-batches (random token ids: the data is not what is timed). The first
worker reports the wall-clock time (`time.time()`) each stage ended at; the script prints them as
one JSON line after the run: the script's imports, the training function's start on the worker
(Ray's start, the trainer's controller and the workers' placement and imports), the model and
the first step.

    python benchmarks/raytrain_first_step.py [key=value ...]
"""

from __future__ import annotations

import time

began = time.time()

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

WORLD = 2


def loop(config: dict) -> None:
    started = time.time()
    import torch
    import torch.nn.functional as F
    from ray import train
    from ray.train.torch import prepare_model

    from rayzero.config import load_config
    from rayzero.models.gpt import build_model

    cfg = load_config(None, config["overrides"])
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = prepare_model(build_model(cfg.model, cfg.block_size, seed=cfg.train.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    built = time.time()
    t = cfg.train
    gen = torch.Generator().manual_seed(rank)
    for _ in range(t.global_batch_size // world // t.micro_batch_size):
        tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    opt.step()
    opt.zero_grad()
    done = time.time()
    if rank == 0:  # a file beside the script's run: Ray Train returns no metrics reported without a checkpoint
        with open(config["stamps"], "w") as f:
            json.dump({"loop_began": started, "model": built, "first_step": done, "loss": loss.item()}, f)
    train.report({"loss": loss.item()})


def main() -> None:
    imported = time.time()
    tmp = tempfile.mkdtemp(prefix="rayzero-raytrain-first-")
    trainer = TorchTrainer(
        loop, train_loop_config={"overrides": sys.argv[1:], "stamps": f"{tmp}/stamps.json"},
        scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=tmp, name="first-step"),
    )
    trainer.fit()
    with open(f"{tmp}/stamps.json") as f:
        m = json.load(f)
    stamps = {"began": began, "imported": imported, "loop_began": m["loop_began"], "model": m["model"],
              "first_step": m["first_step"]}
    print(json.dumps({"stamps": stamps, "world_size": WORLD, "loss": m["loss"]}), flush=True)


if __name__ == "__main__":
    main()
