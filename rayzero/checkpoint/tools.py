"""What `rayzero ckpt` does: list, verify, and export committed checkpoints."""

from __future__ import annotations

import numpy as np
import torch

from rayzero.checkpoint.config import CheckpointConfig
from rayzero.checkpoint.manifest import CheckpointError, Committed, committed
from rayzero.checkpoint.shard_file import ShardReader, verify
from rayzero.checkpoint.shards import locate_saved, saved_pieces
from rayzero.checkpoint.storage import Storage
from rayzero.models.gpt import ModelConfig, build_model


def list_checkpoints(uri: str, cfg: CheckpointConfig | None = None) -> list[dict]:
    """One row per committed checkpoint under `uri` (a checkpoint directory), oldest first."""
    rows = []
    for c in committed(Storage(uri, cfg)):
        lay = c.manifest["layout"]
        rows.append({"uri": c.uri, "step": c.step, "bytes": sum(s["size"] for s in c.manifest["shards"]),
                     "world_size": lay["world_size"], "strategy": lay["strategy"],
                     "created": c.manifest.get("created", "")})
    return rows


def verify_checkpoint(c: Committed) -> int:
    """Read every shard whole and check it against the manifest; returns the bytes checked."""
    for s in c.manifest["shards"]:
        verify(c.storage, s["file"], s)
    return sum(s["size"] for s in c.manifest["shards"])


def consolidated_weights(c: Committed) -> dict[str, torch.Tensor]:
    """The fp32 main parameters, whole, by the model's `state_dict()` names (a tied weight
    under each of its names), read from the shards."""
    m = c.manifest
    lay = m["layout"]
    pieces, starts = saved_pieces(m)
    readers: dict[int, ShardReader] = {}
    by_name = {}
    for name, (start, end) in zip(lay["param_order"], lay["param_world"]):
        out = np.empty(end - start, dtype=np.float32)
        try:
            found = locate_saved(start, end, 0, pieces, starts)
        except ValueError as e:
            raise CheckpointError(f"{c.uri}: {name}: {e}") from None
        for f, off, n, dst in found:
            if f not in readers:
                readers[f] = ShardReader(c.storage, m["shards"][f]["file"], m["shards"][f])
            out[dst : dst + n] = readers[f].read("main", off, off + n)
        by_name[name] = torch.from_numpy(out)
    model = build_model(ModelConfig(**m["model"]), m["block_size"], seed=0, device="meta")
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {k: by_name[name_of[id(v)]].view(v.shape).clone()
            for k, v in model.state_dict(keep_vars=True).items()}
