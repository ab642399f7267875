"""Checkpoints of pipeline stages: each stage saves its own layout, a tied embedding lives in two
stages, and a checkpoint reads back at any number of stages, through the real saver, committer
and reader on local storage, one process, no process group.

A stage rank stands alone in its stage here (`StageMesh`), so its strategy needs no
collective: the pp x 1 mesh the pipeline's own will be.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from rayzero.checkpoint.manifest import open_checkpoint, step_dir
from rayzero.checkpoint.shards import ShardSaver, _pp, apply_shard, layout_record, read_shard
from rayzero.checkpoint.stages import whole_build
from rayzero.checkpoint.tools import consolidated_weights, list_checkpoints
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.config import load_config
from rayzero.models.gpt import build_model
from rayzero.sharding import Mesh, OptimConfig, ShardingConfig, build_strategy
from rayzero.sharding.comm import Axis
from rayzero.workers.assembly import make_spec, whole_counts, whole_shapes
from rayzero.sharding.whole import full_state_dict

STEP = 3
SEQ = 16


class StageMesh:
    """Rank `pp_rank` of a world of `pp` stages of one rank each: what a strategy and the saver
    ask of a mesh (every other axis of size 1)."""

    def __init__(self, pp_rank: int, pp: int):
        self.rank, self.world_size = pp_rank, pp

    def size(self, axis: str) -> int:
        return self.world_size if axis in ("pp", "world") else 1

    def coord(self, axis: str) -> int:
        return self.rank if axis in ("pp", "world") else 0

    def axis(self, name: str) -> Axis:
        return Axis(None, 1, 0)  # no collective runs on an axis of one rank


@pytest.fixture
def cfg(tmp_path):
    return load_config(None, ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.vocab_size=64",
                              f"train.seq_len={SEQ}", "train.steps=10", "train.seed=0", f"checkpoint.dir={tmp_path}"])


def stages_of(whole: nn.Module) -> list[nn.Module]:
    """The two stages of a 4-block GPT under its own names: the embeddings and blocks 0-1; blocks
    2-3, the final norm and the head, tied to a copy of the token embedding (`wte.weight`)."""
    first, last = copy.deepcopy(whole), copy.deepcopy(whole)
    first.blocks = nn.ModuleList(first.blocks[:2])
    del first.ln_f, first.lm_head
    last.blocks = nn.ModuleDict({"2": last.blocks[2], "3": last.blocks[3]})
    del last.wpe
    assert last.lm_head.weight is last.wte.weight
    return [first, last]


def strategy(model: nn.Module, mesh, bucket_numel: int = 3000):
    return build_strategy("optim", model, mesh, ShardingConfig(bucket_numel=bucket_numel), OptimConfig())


def flat(s, truth: dict[str, dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    """What a strategy's owned shard of `key` holds when every parameter is `truth[name][key]`
    (padding: zeros)."""
    lay, names = s.buffer.layout, s.buffer.names
    out = torch.zeros(sum(m.numel() for m in s.main_params))
    for own, local in s.pieces():
        for span in lay.params:
            cut = span.world.intersect(own)
            if cut is None or not cut.size:
                continue
            lo = cut.start - span.world.start
            dst = local + cut.start - own.start
            out[dst : dst + cut.size] = truth[names[span.index]][key].reshape(-1)[lo : lo + cut.size]
    return out


def install(s, truth) -> None:
    apply_shard(s, {k: flat(s, truth, k) for k in ("main", "exp_avg", "exp_avg_sq")}, adam_steps=STEP)


def info(s, model, spec) -> dict:
    """A rank's setup report, as `Rank.setup` gives it for its stage."""
    pp_rank, pp = _pp(s.mesh)
    n, trainable = whole_counts(model, None)
    layers = len(model.blocks)
    return {"rank": s.mesh.rank, "pp_rank": pp_rank, "pp": pp, "saves_shard": s.saves_shard,
            "layout": layout_record(s), "params": whole_shapes(model, None), "frozen": [],
            "model": spec.record(), "num_params": n, "trainable_params": trainable, "params_per_rank": n,
            "flops_per_token": 6.0 * n + 12.0 * layers * spec.cfg.n_embd * SEQ, "memory": {"total": n}}


def commit(cfg, strategies, models, spec) -> str:
    """Save every strategy's shard and commit the manifest, as the controller does."""
    ckpt = Checkpoints(cfg)
    ckpt.configure([info(s, m, spec) for s, m in zip(strategies, models)], mlflow_run_id=None)
    prefix = ckpt.root.child(step_dir(STEP))
    uploads = []
    for s in strategies:
        saver = ShardSaver(s, asynchronous=False)
        saver.save(prefix, STEP)
        uploads += saver.reports()
    ckpt.collect(STEP - 1, [{"checkpointed": True, "loss_scale": None, "lr": 1e-3, "uploads": uploads}])
    assert ckpt.last_committed == prefix.uri
    return prefix.uri


@pytest.fixture
def setup(cfg):
    spec = make_spec(cfg)
    whole = build_model(cfg.model, cfg.block_size, seed=0)
    g = torch.Generator().manual_seed(1)
    truth = {n: {k: torch.randn(p.shape, generator=g) for k in ("main", "exp_avg", "exp_avg_sq")}
             for n, p in whole.named_parameters()}
    return spec, whole, truth


def check(s, c, truth) -> None:
    got = read_shard(s, c.storage, c.manifest)
    for k in ("main", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got[k], flat(s, truth, k)), k


def test_stage_shards_read_back_whole_and_by_stage(cfg, setup):
    spec, whole, truth = setup
    models = stages_of(whole)
    saved = [strategy(m, StageMesh(k, 2)) for k, m in enumerate(models)]
    install(saved[0], truth)
    # The tied embedding's copy in the last stage, made to differ: the first stage's is read.
    install(saved[1], {**truth, "wte.weight": {k: v + 1 for k, v in truth["wte.weight"].items()}})
    c = open_checkpoint(commit(cfg, saved, models, spec), cfg.checkpoint)

    m = c.manifest
    assert [s["pp_rank"] for s in m["shards"]] == [0, 1]
    assert [lay["pp_rank"] for lay in m["layout"]["stages"]] == [0, 1]
    assert {p["name"] for p in m["params"]} == {n for n, _ in whole.named_parameters()}
    assert list_checkpoints(str(cfg.checkpoint.dir), cfg.checkpoint)[-1]["pp"] == 2

    one = strategy(copy.deepcopy(whole), Mesh(1), bucket_numel=5000)  # another layout: resharded
    check(one, c, truth)
    apply_shard(one, read_shard(one, c.storage, c.manifest), m["optimizer"]["step_count"])
    state = full_state_dict(one)
    for name, t in truth.items():
        assert torch.equal(state[name], t["main"]), name
    assert torch.equal(state["lm_head.weight"], truth["wte.weight"]["main"])

    for k, model in enumerate(stages_of(whole)):
        check(strategy(model, StageMesh(k, 2), bucket_numel=2000), c, truth)

    exported = consolidated_weights(c, cfg.checkpoint)  # `rayzero ckpt export` reads it whole
    for name, t in truth.items():
        assert torch.equal(exported[name], t["main"]), name


def test_a_checkpoint_without_stages_reads_into_stages(cfg, setup):
    spec, whole, truth = setup
    one = strategy(copy.deepcopy(whole), Mesh(1))
    install(one, truth)
    c = open_checkpoint(commit(cfg, [one], [whole], spec), cfg.checkpoint)
    assert "stages" not in c.manifest["layout"] and c.manifest["shards"][0]["pp_rank"] == 0
    for k, model in enumerate(stages_of(whole)):
        check(strategy(model, StageMesh(k, 2)), c, truth)


def test_an_older_manifest_without_stage_keys_reads_as_before(cfg, setup):
    spec, whole, truth = setup
    one = strategy(copy.deepcopy(whole), Mesh(1))
    install(one, truth)
    c = open_checkpoint(commit(cfg, [one], [whole], spec), cfg.checkpoint)
    for key in ("pp_rank", "pp"):
        del c.manifest["layout"][key]
    for s in c.manifest["shards"]:
        del s["pp_rank"]
    check(strategy(copy.deepcopy(whole), Mesh(1), bucket_numel=5000), c, truth)


def test_whole_build_counts_a_tied_embedding_once(cfg, setup):
    spec, whole, _ = setup
    models = stages_of(whole)
    models[0].wpe.weight.requires_grad_(False)
    infos = [info(strategy(m, StageMesh(k, 2)), m, spec) for k, m in enumerate(models)]
    infos[0]["frozen"] = ["wpe.weight"]
    replica = {**infos[1], "rank": 3}  # a later rank of the last stage: not read
    b = whole_build([infos[0], infos[1], replica])
    n = sum(p.numel() for p in whole.parameters())  # the tied weight once
    assert b["num_params"] == n
    assert b["trainable_params"] == n - whole.wpe.weight.numel()
    assert b["flops_per_token"] == spec.flops_per_token(whole, SEQ)  # what the unstaged model reports
    assert b["params_per_rank"] == max(i["num_params"] for i in infos)
    assert list(b["params"]) == list(infos[0]["params"]) + [x for x in infos[1]["params"] if x != "wte.weight"]
    assert b["frozen"] == ["wpe.weight"] and b["memory"] == infos[0]["memory"]
    assert [s["pp_rank"] for s in b["stages"]] == [0, 1] and b["stages"][1]["memory"] == infos[1]["memory"]
    assert b["layout"]["stages"] == [infos[0]["layout"], infos[1]["layout"]]
    assert b["layout"]["param_order"] == infos[0]["layout"]["param_order"]
    alone = {**infos[0], "pp_rank": 0, "pp": 1}
    assert whole_build([alone]) is alone and whole_build([{"rank": 0}, {"rank": 1}])["rank"] == 0


def test_a_mesh_without_a_pp_axis_is_one_stage():
    assert _pp(Mesh(4, rank=3)) == (0, 1)
    assert _pp(StageMesh(1, 2)) == (1, 2)


def test_a_checkpoint_dir_the_nodes_do_not_share_is_said_at_the_first_commit(cfg, setup, tmp_path):
    """Shards a rank wrote to its own node's disk are not where the driver commits them: the run
    ends at its first commit, naming the ranks, instead of committing what no resume can read."""
    from rayzero.cluster.checkpoints import CheckpointNotShared
    from rayzero.storage import Storage

    spec, whole, _ = setup
    models = stages_of(whole)
    saved = [strategy(m, StageMesh(k, 2)) for k, m in enumerate(models)]
    ckpt = Checkpoints(cfg)
    ckpt.configure([info(s, m, spec) for s, m in zip(saved, models)], mlflow_run_id=None)
    prefix = ckpt.root.child(step_dir(STEP))
    elsewhere = Storage(str(tmp_path / "another-node"))  # where the second rank's node wrote its shard
    uploads = []
    for k, s in enumerate(saved):
        saver = ShardSaver(s, asynchronous=False)
        saver.save(prefix if k == 0 else elsewhere, STEP)
        uploads += saver.reports()
    with pytest.raises(CheckpointNotShared, match=rf"the shard of rank 1 \(written on its own node\) is not in "
                                                  rf".*step-{STEP:06d} on the driver's node; .*shared filesystem"):
        ckpt.collect(STEP - 1, [{"checkpointed": True, "loss_scale": None, "lr": 1e-3, "uploads": uploads}])
    assert ckpt.last_committed is None and prefix.size("manifest.json") is None
