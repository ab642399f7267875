"""Bucket groups: a mixture of experts' routed experts are buckets of their own, in a group with
the mesh's expert roles as its axes, and the step, the norm and a checkpoint's pieces run over
the groups (one process, a mesh of one rank: the multi-rank runs are the generated
configurations' mixtures of experts, against their oracle)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from rayzero.checkpoint.shards import _pick
from rayzero.models.spec import ModelSpec
from rayzero.sharding import Mesh, OptimConfig, ShardingConfig, build_strategy
from rayzero.sharding.whole import full_state_dict


class Experts(nn.Module):
    def __init__(self, n: int, d: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(n, d, 2 * d) / d**0.5)
        self.down = nn.Parameter(torch.randn(n, 2 * d, d) / d**0.5)


class Block(nn.Module):
    """A router, routed experts and a shared expert (dense: every token uses it)."""

    def __init__(self, d: int = 8, n: int = 4):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = Experts(n, d)
        self.shared_expert = nn.Linear(d, d)

    def forward(self, x):
        weights = self.gate(x).softmax(-1)  # every expert, weighted: enough to train each one
        routed = torch.einsum("bte,edh,ehk->btk", weights, self.experts.up, self.experts.down)
        return x + routed + self.shared_expert(x)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def strategy(m: nn.Module, experts: bool, name: str = "optim"):
    names = ModelSpec.experts(m) if experts else frozenset()
    return build_strategy(name, m, Mesh(1), ShardingConfig(bucket_numel=64), OptimConfig(grad_clip=0.1),
                          experts=names)


def test_the_seam_names_the_routed_experts_not_the_router_or_the_shared_expert():
    assert ModelSpec.experts(model()) == {f"{i}.experts.{w}" for i in (0, 1) for w in ("up", "down")}


def test_the_experts_are_buckets_of_their_own_in_a_group_over_the_expert_roles():
    for name in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        s = strategy(model(), experts=True, name=name)
        assert [p.group.key.name for p in s.groups] == ["dense/float32", "expert/float32"], name
        dense, expert = (p.group for p in s.groups)
        for group, want in ((dense, False), (expert, True)):
            for b in group.buckets:
                assert {".experts." in s.buffer.names[i] for i in b.params} == {want}, name
        mesh = s.mesh
        assert (expert.axis.size, expert.outer.size, expert.reduce.size) == (
            mesh.size("expert_shard"), mesh.size("expert_replicate"), mesh.size("expert_dp"))
        assert s.group_record()["expert/float32"]["params"] == [n for b in expert.buckets
                                                                for n in (s.buffer.names[i] for i in b.params)]


def test_steps_over_two_groups_equal_those_over_one():
    """The same model and batches: grouping moves the experts to buckets of their own, and the
    clipped steps (the norm summed group by group) land where one group's do."""
    base = model()
    runs = {}
    for experts in (False, True):
        m = copy.deepcopy(base)
        s = strategy(m, experts)
        torch.manual_seed(1)
        for _ in range(3):
            s.begin_step()
            loss = m(torch.randn(2, 5, 8)).square().mean()
            s.backward(loss, last_microbatch=True)
            s.finish_grad_sync()
            s.step(lr=1e-2)
        runs[experts] = full_state_dict(s)
    assert runs[False].keys() == runs[True].keys()
    for k, v in runs[False].items():
        assert torch.allclose(runs[True][k], v, rtol=1e-6, atol=1e-7), k
    assert any(not torch.equal(runs[True][k], base.state_dict()[k]) for k in runs[True]), "it trained"


def test_a_checkpoint_holds_the_pieces_of_the_groups_this_rank_writes():
    s = strategy(model(), experts=True)
    every = s.pieces()
    assert [o for _, o in every] == [sum(r.size for r, _ in every[:k]) for k in range(len(every))]
    assert s.pieces(saved=True) == every and s.saves_shard  # one rank: it writes every group
    expert = s.groups[1]
    owner = expert.owner

    class Replica:  # the expert group's pieces left to another replica
        saves_shard = False
        owned = staticmethod(owner.owned)

    expert.owner = Replica()
    saved = s.pieces(saved=True)
    mine = {b.index for b in expert.group.buckets}
    assert saved == [(r, o) for (r, o), b in zip(every, s.buffer.buckets) if b.index not in mine]
    flat = torch.arange(sum(r.size for r, _ in every), dtype=torch.float32)
    assert torch.equal(_pick(flat, saved), torch.cat([flat[o:o + r.size] for r, o in saved]))
    assert _pick(flat, every) is flat


def test_a_step_whose_gradients_are_not_finite_is_skipped_on_the_device():
    """Without a loss scale the norm and the clipping stay on the device and the fused AdamW
    skips a step whose gradients are not finite (`found_inf`): the parameters, the AdamW state
    and its step count stay as they were, and the steps after it are those of a run that never
    met it, bit for bit."""
    base = model()
    torch.manual_seed(1)
    batches = [torch.randn(2, 5, 8) for _ in range(3)]
    runs = {}
    for bad in (False, True):
        m = copy.deepcopy(base)
        s = strategy(m, experts=True, name="optim_grads_params")
        for k, x in enumerate(batches):
            for poisoned in ((False, True) if bad and k == 1 else (False,)):
                before = (full_state_dict(s), s.optimizer.step_count, [t.clone() for t in s.optimizer.exp_avg])
                s.begin_step()
                loss = m(x).square().mean()
                s.backward(loss * float("nan") if poisoned else loss, last_microbatch=True)
                s.finish_grad_sync()
                norm = s.step(lr=1e-2)
                assert s.last_step_skipped == poisoned == math.isnan(norm)
                if poisoned:
                    state = full_state_dict(s)
                    assert all(torch.equal(state[n], before[0][n]) for n in state)
                    assert s.optimizer.step_count == before[1]
                    assert all(torch.equal(a, b) for a, b in zip(s.optimizer.exp_avg, before[2]))
        runs[bad] = (full_state_dict(s), s.optimizer.state_dict())
    (clean, clean_opt), (skipped, skipped_opt) = runs[False], runs[True]
    assert all(torch.equal(clean[n], skipped[n]) for n in clean)
    assert clean_opt["step"] == skipped_opt["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(clean_opt["exp_avg_sq"], skipped_opt["exp_avg_sq"]))
