"""Pipeline stages: the split of a model's blocks, a rank's model made of its stages (names kept,
the tied weight on both end stages), a chunk run on its own, and every bad input refused by the
dry run before anything starts, in one message each."""

import json

import pytest
import torch
import torch.nn as nn

from rayzero.config import load_config
from rayzero.jobs import cli
from rayzero.models.errors import ModelError
from rayzero.pipeline.stages import StageRunner, balanced, plan_stages, split
from rayzero.workers.assembly import build_model, make_spec, stage_plan


def gpt(n_layer=4, **extra):
    cfg = load_config(None, [f"model.n_layer={n_layer}", "model.n_embd=32", "model.n_head=2", "train.seq_len=16",
                             *[f"{k}={v}" for k, v in extra.items()]])
    spec = make_spec(cfg)
    return cfg, spec, build_model(cfg, spec).model


def test_balanced_cuts_minimize_the_heaviest_stage():
    assert balanced([1, 1, 1, 1], 2) == [2, 2]
    assert balanced([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    w, counts = [3, 1, 1, 1, 1, 3], balanced([3, 1, 1, 1, 1, 3], 3)
    cuts = [sum(counts[:i]) for i in range(4)]
    assert max(sum(w[a:b]) for a, b in zip(cuts, cuts[1:])) == 4  # the best any split does
    counts = balanced([2] * 10, 4)
    assert sum(counts) == 10 and max(counts) == 3


def test_the_gpt_splits_into_its_blocks_with_the_ends_on_the_end_stages():
    cfg, spec, model = gpt(**{"parallel.pp": 2, "cluster.num_workers": 2})
    plan = stage_plan(cfg, spec, model)
    assert plan.first == ("wte", "wpe") and plan.last == ("ln_f", "lm_head")
    # the embeddings weigh on the first stage: it takes fewer blocks when they outweigh one
    assert sum(plan.counts) == 4 and plan.modules(0)[:2] == ("wte", "wpe")
    even = plan_stages(model, plan.blocks, 2, layers=[2, 2])
    assert even.stage_blocks(1) == ("blocks.2", "blocks.3")
    inter = plan_stages(model, plan.blocks, 2, virtual=2)
    assert inter.stages_of(0) == [0, 2] and inter.stage_blocks(2) == ("blocks.2",)


def test_a_stage_keeps_the_models_names_and_the_tied_weight():
    cfg, spec, model = gpt(**{"parallel.pp": 2, "cluster.num_workers": 2})
    plan = plan_stages(model, spec.stage_blocks(model), 2, layers=[2, 2])
    whole = {n for n, _ in model.named_parameters()}
    parts = []
    for r in range(2):
        _, _, m = gpt(**{"parallel.pp": 2, "cluster.num_workers": 2})
        stages = split(m, plan, r)
        parts.append(({n for n, _ in m.named_parameters()}, stages))
    (first, s0), (last, s1) = parts
    assert first | last == whole and first & last == {"wte.weight"}
    assert s0.tied == s1.tied == {"wte.weight"} and s0.any_tied and s0.first and s1.last
    assert "blocks.3.mlp.fc.weight" in last and "blocks.3.mlp.fc.weight" not in first


def test_two_stages_run_in_turn_give_the_whole_models_logits():
    torch.manual_seed(0)
    cfg, spec, model = gpt()
    whole = build_model(cfg, spec).model  # meta: give both the same real weights
    model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    state = model.state_dict()
    plan = plan_stages(model, spec.stage_blocks(model), 2, layers=[1, 3])
    runners = []
    for r in range(2):
        m = build_model(cfg, spec).model
        m.to_empty(device="cpu")
        m.lm_head.weight = m.wte.weight
        stages = split(m, plan, r)
        m.load_state_dict({k: v for k, v in state.items() if k in m.state_dict()}, strict=False)
        runners.append(StageRunner(m, stages))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    hidden = runners[0].run(0, None, lambda m: m(x))
    assert hidden.shape == (2, 16, 32)
    logits = runners[1].run(0, hidden, lambda m: m(x))
    assert torch.allclose(logits, model(x), atol=1e-6)
    del whole


def test_a_module_without_a_pipeline_hook_is_refused_by_name():
    from rayzero.models.module import ModuleSpec

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    spec = ModuleSpec.__new__(ModuleSpec)
    with pytest.raises(ModelError, match="pipeline_blocks"):
        spec.stage_blocks(Net())
    Net.pipeline_blocks = lambda self: ["layers.0", "layers.1"]
    assert spec.stage_blocks(Net()) == ["layers.0", "layers.1"]


def dry_run(tmp_path, capsys, *overrides):
    out = tmp_path / "plan.json"
    code = cli.main(["train", "--dry-run", "--summary-json", str(out), "model.n_layer=4", "model.n_embd=32",
                     "model.n_head=2", "train.seq_len=16", *overrides])
    captured = capsys.readouterr()
    return code, captured, (json.loads(out.read_text()) if code == 0 else None)


@pytest.mark.parametrize("overrides,message", [
    (["cluster.num_workers=2", "parallel.pp=3"], "parallel.pp: 3 does not divide cluster.num_workers (2)"),
    (["cluster.num_workers=2", "parallel.pp=2", "model.n_layer=1"], "parallel.pp: 2 stages but the model has 1 blocks"),
    (["cluster.num_workers=2", "parallel.pp=2", "train.global_batch_size=2", "train.micro_batch_size=2"],
     "1f1b needs at least parallel.pp (2) micro-batches per step; got 1"),
    (["cluster.num_workers=2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
      "parallel.pp_virtual_stages=2", "model.n_layer=6"], "splits the 6 blocks evenly over parallel.pp x"),
    (["cluster.num_workers=2", "parallel.pp=2", "parallel.pp_layers=1,2"],
     "parallel.pp_layers: [1, 2] sum to 3, but the model has 4 blocks"),
    (["cluster.num_workers=2", "parallel.pp=2", "parallel.pp_layers=4"], "parallel.pp_layers: 1 entries for 2 stages"),
    (["cluster.num_workers=2", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
     "interleaved_1f1b needs parallel.pp_virtual_stages of at least 2"),
    (["cluster.num_workers=2", "parallel.pp=2", "parallel.pp_schedule=zero_bubble",
      "sharding.strategy=optim_grads_params"], "zero_bubble runs each micro-batch's weight gradients apart"),
    (["cluster.num_workers=2", "parallel.pp=2", "parallel.pp_schedule=zero_bubble",
      "model.activation_checkpointing=selective"], "zero_bubble runs each block's backward twice"),
])
def test_each_bad_pipeline_input_is_one_message_before_anything_starts(tmp_path, capsys, overrides, message):
    code, out, _ = dry_run(tmp_path, capsys, *overrides)
    assert code == 2 and message in out.err, out.err
    assert out.err.count("rayzero: error") == 1


def test_the_dry_run_shows_each_stage_its_ranks_blocks_and_memory(tmp_path, capsys):
    code, out, plan = dry_run(tmp_path, capsys, "cluster.num_workers=4", "cluster.cpus_per_worker=0.5",
                              "parallel.pp=2", "parallel.pp_layers=1,3", "train.global_batch_size=16",
                              "train.micro_batch_size=2")
    assert code == 0, out.err
    pp = plan["pipeline"]
    assert [r["ranks"] for r in pp["ranks"]] == [[0, 1], [2, 3]]
    assert pp["ranks"][0]["modules"] == ["wte, wpe, blocks.0"]
    assert pp["bubble"] == pytest.approx(1 / 4)  # (pp - 1) / m at 4 micro-batches
    assert [r["in_flight"] for r in pp["ranks"]] == [2, 1]
    assert "pp rank 1 (ranks 2, 3): blocks.1 … blocks.3 (3 blocks), ln_f, lm_head" in out.out
