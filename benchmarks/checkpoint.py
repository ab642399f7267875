"""Checkpoint throughput against raw pyarrow.fs on the same S3 server, and the training stall.

Against a SeaweedFS S3 server on loopback (`weed mini`, started here), one process, 3 rounds:
  - save: `write_shard` (safetensors streamed with per-block SHA-256) of one rank's shard of
    the `medium` model (85M parameters: fp32 main parameters + two Adam moments, ~1 GiB)
    against one raw `open_output_stream` write of the same bytes; MB/s and the ratio;
  - load: `read_shard` (ranged, verified reads into this rank's shard) against raw `read_at`
    of the whole file; MB/s and the ratio. Target for both: >= 0.8x raw.
  - stall: a `small`-model rank (world 1) trains 24 steps with an async checkpoint every 6;
    per checkpoint, the time the step was held, against the time of the snapshot copy alone
    (target <= 1.5x) and against the median step time.

    python benchmarks/checkpoint.py [--json PATH] [--preset medium]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rayzero.checkpoint.shard_file import write_shard  # noqa: E402
from rayzero.checkpoint.shards import layout_record, read_shard  # noqa: E402
from rayzero.storage import Storage  # noqa: E402
from rayzero.cluster.checkpoints import Checkpoints  # noqa: E402
from rayzero.config import load_config  # noqa: E402
from rayzero.data.corpus import ensure_default_corpus  # noqa: E402
from rayzero.jobs.train import resolve_data  # noqa: E402
from rayzero.workers.rank import Rank  # noqa: E402
from tests.s3server import SeaweedS3, free_port  # noqa: E402

ROUNDS = 3


def rank(cfg, data_path):
    r = Rank(cfg, 0, 1, data_path)
    r.setup("127.0.0.1", free_port())
    return r


def throughput(server: SeaweedS3, data_path: str, preset: str) -> dict:
    cfg = load_config(None, ["cluster.num_workers=1", f"model.preset={preset}", "sharding.strategy=optim",
                             *server.overrides()])
    r = rank(cfg, data_path)
    s = r.strategy
    tensors = {"main": torch.cat([m.reshape(-1) for m in s.main_params]),
               "exp_avg": s.optimizer.exp_avg.clone(), "exp_avg_sq": s.optimizer.exp_avg_sq.clone()}
    raw = b"".join(memoryview(t.numpy()).cast("B") for t in tensors.values())
    storage = Storage("s3://bench/tp", cfg.checkpoint)
    fs, base = storage.fs, storage.base
    rows = []
    for k in range(ROUNDS):
        t0 = time.perf_counter()
        with fs.open_output_stream(f"{base}/raw-{k}.bin") as f:
            f.write(raw)
        raw_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        entry = write_shard(storage, f"shard-{k}.safetensors", tensors, {"step": "0"})
        ours_save = time.perf_counter() - t0
        manifest = {"layout": layout_record(s),  # what the manifest of a commit holds of this shard
                    "params": [{"name": n, "shape": list(p.shape)} for n, p in r.model.named_parameters()],
                    "shards": [{"file": f"shard-{k}.safetensors", "pieces": [[o.start, o.end] for o, _ in s.pieces()],
                                **entry}]}
        t0 = time.perf_counter()
        with fs.open_input_file(f"{base}/raw-{k}.bin") as f:
            got = f.read_at(len(raw), 0)
        raw_load = time.perf_counter() - t0
        assert len(got) == len(raw)
        del got
        t0 = time.perf_counter()
        read_shard(s, storage, manifest)
        ours_load = time.perf_counter() - t0
        mb = len(raw) / 2**20
        rows.append({"bytes": len(raw), "raw_save_mb_s": mb / raw_save, "save_mb_s": entry["size"] / 2**20 / ours_save,
                     "raw_load_mb_s": mb / raw_load, "load_mb_s": mb / ours_load,
                     "save_ratio": raw_save / ours_save * entry["size"] / len(raw), "load_ratio": raw_load / ours_load})
        print(f"round {k + 1}: {mb:.0f} MiB; save {rows[-1]['save_mb_s']:.0f} MB/s vs raw "
              f"{rows[-1]['raw_save_mb_s']:.0f} ({rows[-1]['save_ratio']:.2f}x); load {rows[-1]['load_mb_s']:.0f} "
              f"vs raw {rows[-1]['raw_load_mb_s']:.0f} ({rows[-1]['load_ratio']:.2f}x)")
    r.close()
    return {"rounds": rows, "save_ratio": statistics.median(r["save_ratio"] for r in rows),
            "load_ratio": statistics.median(r["load_ratio"] for r in rows), "bytes": len(raw)}


def stall(server: SeaweedS3, data_path: str) -> dict:
    cfg = load_config(None, ["cluster.num_workers=1", "model.preset=small", "train.steps=24",
                             "train.global_batch_size=8", "train.micro_batch_size=4", "train.seq_len=128",
                             "checkpoint.dir=s3://bench/stall", "checkpoint.every_steps=6", *server.overrides()])
    r = rank(cfg, data_path)
    ckpt = Checkpoints(cfg)
    steps, stalls = [], []
    for k in range(cfg.train.steps):
        t0 = time.perf_counter()
        res = r.iteration({"step": k, "lr": 1e-3, "checkpoint": ckpt.plan(k)})
        steps.append(time.perf_counter() - t0)
        if res["phase_s"]["checkpoint"]:
            stalls.append(res["phase_s"]["checkpoint"])
    r.finish_checkpoints()
    s = r.strategy
    copies = []
    for _ in range(5):  # the snapshot alone: the same three host copies
        t0 = time.perf_counter()
        torch.cat([m.detach().reshape(-1) for m in s.main_params])
        s.optimizer.exp_avg.detach().to("cpu", copy=True)
        s.optimizer.exp_avg_sq.detach().to("cpu", copy=True)
        copies.append(time.perf_counter() - t0)
    r.close()
    copy = statistics.median(copies)
    step = statistics.median(steps[1:])
    return {"stall_s": stalls, "snapshot_copy_s": copy, "median_step_s": step,
            "stall_over_copy": statistics.median(stalls) / copy, "stall_over_step": statistics.median(stalls) / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--preset", default="medium")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    data_path = ensure_default_corpus("~/.cache/rayzero/datasets")
    resolve_data(load_config(None, [f"data.path={data_path}"]))
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedS3(Path(tmp))
        server.start()
        try:
            tp = throughput(server, data_path, args.preset)
            st = stall(server, data_path)
        finally:
            server.stop()
    print(f"\nsave / raw pyarrow write: {tp['save_ratio']:.2f}x (target >= 0.8); "
          f"load / raw pyarrow read: {tp['load_ratio']:.2f}x (target >= 0.8)")
    print(f"async checkpoint stall: median {statistics.median(st['stall_s']) * 1e3:.1f} ms "
          f"(each: {', '.join(f'{s * 1e3:.1f}' for s in st['stall_s'])}); snapshot copy alone "
          f"{st['snapshot_copy_s'] * 1e3:.1f} ms -> {st['stall_over_copy']:.2f}x (target <= 1.5); "
          f"median step {st['median_step_s'] * 1e3:.1f} ms -> stall is {st['stall_over_step']:.1%} of a step")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "checkpoint", "throughput": tp, "stall": st}, indent=2))


if __name__ == "__main__":
    main()
