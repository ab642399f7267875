"""Named axes from world size, dp_outer and tp; tensor-parallel slices of whole tensors; FSDP
unit discovery on the built-in GPT."""

import pytest
import torch

from rayzero.models.gpt import ModelConfig, build_model
from rayzero.sharding.fsdp import ROOT, _reads_no_weights, find_units
from rayzero.sharding.layout import build_layout
from rayzero.sharding.flat_buffer import FillSource
from rayzero.sharding.tensor_parallel import Split, TPLayout, TPSlices
from rayzero.sharding.mesh import Mesh, MeshError


@pytest.mark.parametrize("world, outer", [(1, 1), (4, 1), (4, 2), (6, 3), (6, 2), (8, 4), (4, 4)])
def test_every_rank_is_in_exactly_one_group_per_axis(world, outer):
    for axis, size in (("shard", world // outer), ("replicate", outer)):
        groups = Mesh(world, 0, outer).groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        t = Mesh(world, rank, outer)
        shard, rep = t.my_group("shard"), t.my_group("replicate")
        assert shard[t.coord("shard")] == rank and rep[t.coord("replicate")] == rank
        assert set(shard) & set(rep) == {rank}
        assert rank == t.coord("replicate") * t.size("shard") + t.coord("shard")


def test_shard_groups_are_consecutive_ranks():
    assert Mesh(4, 0, 2).groups("shard") == [[0, 1], [2, 3]]
    assert Mesh(4, 0, 2).groups("replicate") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("world, rank, outer", [(4, 0, 3), (4, 4, 1), (3, 0, 0)])
def test_impossible_topologies_are_refused(world, rank, outer):
    with pytest.raises(ValueError):
        Mesh(world, rank, outer)


@pytest.mark.parametrize("world, outer, tp", [(4, 1, 2), (4, 1, 4), (4, 2, 2), (8, 2, 2), (8, 1, 2), (6, 1, 3),
                                              (2, 2, 1)])
def test_the_mesh_has_every_rank_once_per_axis_and_tp_groups_are_consecutive(world, outer, tp):
    t0 = Mesh(world, 0, outer, tp)
    for axis, size in (("shard", world // (outer * tp)), ("replicate", outer), ("tp", tp), ("batch", world // tp)):
        groups = t0.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(world)), axis
        assert all(len(g) == size for g in groups), axis
    assert all(g == list(range(g[0], g[0] + tp)) for g in t0.groups("tp"))
    assert t0.groups("node") == t0.groups("tp")  # the ranks the placement keeps on one node
    for rank in range(world):
        t = Mesh(world, rank, outer, tp)
        for axis in ("shard", "replicate", "tp", "batch"):
            assert t.my_group(axis)[t.coord(axis)] == rank, axis
        assert set(t.my_group("tp")) & set(t.my_group("batch")) == {rank}
        # a data-parallel rank's TP group sees one part of the batch: its batch rank is the group's index
        assert {Mesh(world, r, outer, tp).coord("batch") for r in t.my_group("tp")} == {t.coord("batch")}
        assert t.coord("batch") == t.coord("replicate") * t.size("shard") + t.coord("shard")
        # the roles over the data-parallel ranks are today's two axes, and ZeRO's are each one of them
        for role in ("loss", "grad_reduce", "expert_dp"):
            assert t.my_group(role) == t.my_group("batch"), role
        assert t.my_group("grad_shard") == t.my_group("shard") and t.my_group("grad_replicate") == t.my_group("replicate")


def test_the_mesh_in_words_and_a_wrong_product_named():
    assert Mesh(8, 0, 2, 2).describe() == [
        "mesh: replicate 2 x shard 2 x tp 2 = 8 ranks",
        "  replicate groups [0, 4] [1, 5] [2, 6] [3, 7]",
        "  shard     groups [0, 2] [1, 3] [4, 6] [5, 7]",
        "  tp        groups [0, 1] [2, 3] [4, 5] [6, 7]",
        "  batch, loss, grad_reduce, expert_dp groups [0, 2, 4, 6] [1, 3, 5, 7]"]
    with pytest.raises(ValueError, match="unknown role 'shard'; roles are batch, loss"):
        Mesh(8, 0, 2, 2).axis("shard")  # outside the mesh, code asks for roles
    with pytest.raises(MeshError, match=r"sharding.dp_outer x parallel.tp: 2 x 4 = 8 does not divide cluster.num_workers \(4\)"):
        Mesh(4, 0, 2, 4)


@pytest.mark.parametrize("split, shape, tp", [(Split(0), (8, 3), 2), (Split(1), (4, 6), 3),
                                              (Split(0, parts=3), (12, 2), 2), (Split(0), (8,), 4)])
def test_each_tp_rank_reads_exactly_its_slice_of_the_whole_tensor(split, shape, tp):
    """TPSlices maps a rank's local elements (whole or any range of them) to the whole
    tensor's, as Megatron splits it: rows, columns, or each fused part's rows."""
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    if split.dim == 0:
        expect = [torch.cat([p.chunk(tp)[r] for p in whole.chunk(split.parts)]) for r in range(tp)]
    else:
        expect = list(whole.chunk(tp, dim=1))
    source = FillSource(lambda name, out: out.copy_(whole))
    for r in range(tp):
        layout = TPLayout(tp, r, {"w": split}, {"w": shape})
        local = torch.empty(split.local_shape(shape, tp))
        TPSlices(source, layout).fill("w", local)
        assert torch.equal(local, expect[r])
        from rayzero.sharding.flat_buffer import Piece

        part = torch.empty(local.numel() - 2)  # a range that starts and ends inside runs
        TPSlices(source, layout).fill_pieces([Piece("w", 1, local.numel() - 1, tuple(local.shape), part)])
        assert torch.equal(part, expect[r].reshape(-1)[1:-1])


def gpt(n_layer=2):
    return build_model(ModelConfig(n_layer=n_layer, n_head=2, n_embd=16), 8, seed=0, device="meta")


def test_default_units_of_the_gpt():
    units = find_units(gpt(), ("Block", "Embedding", "LayerNorm", "Linear"))
    assert units.modules == ("wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head")
    assert units.owner["blocks.1.attn.qkv.weight"] == 3  # inside a Block: the outermost wins
    assert units.owner["wte.weight"] == 0 and ROOT not in units.owner.values()
    assert units.users["lm_head"] == frozenset({0}), "the tied head gathers the embedding's unit"
    assert units.users["blocks.0"] == frozenset({2})


def test_parameters_outside_every_unit_form_the_root_and_a_borrowing_module_is_hooked():
    units = find_units(gpt(), ("Block", "Embedding"))
    assert units.modules == ("wte", "wpe", "blocks.0", "blocks.1")
    assert units.owner["ln_f.weight"] == ROOT
    assert units.users["lm_head"] == frozenset({0}), "lm_head is in no unit but uses wte's weight"
    only_blocks = find_units(gpt(), ("Block",))
    assert only_blocks.owner["wte.weight"] == ROOT and "lm_head" not in only_blocks.users


def test_an_embedding_s_backward_is_taken_as_reading_no_weights_and_reads_none():
    """ZeRO-3 gathers no embedding for its backward: its weight's gradient, computed with the
    weight's storage freed (as a released unit's is), is the one computed with it whole."""
    torch.manual_seed(0)
    emb, ids = torch.nn.Embedding(11, 4, padding_idx=0), torch.tensor([[0, 3, 3, 7], [10, 1, 3, 0]])
    out = torch.randn(2, 4, 4)
    (emb(ids) * out).sum().backward()
    whole, emb.weight.grad = emb.weight.grad.clone(), None
    y = emb(ids)
    emb.weight.data.untyped_storage().resize_(0)  # what a released unit's parameters are
    (y * out).sum().backward()
    assert torch.equal(emb.weight.grad, whole)
    assert _reads_no_weights(emb)

    class Scaled(torch.nn.Embedding):  # a subclass's own forward may read its weight any way
        def forward(self, x):
            return super().forward(x) * self.weight.norm()

    compiled = torch.nn.Embedding(11, 4)
    compiled.forward = lambda x: torch.nn.Embedding.forward(compiled, x)  # an instance's forward in its place
    for module in (Scaled(11, 4), torch.nn.Embedding(11, 4, max_norm=1.0), compiled, torch.nn.Linear(4, 4),
                   torch.nn.LayerNorm(4)):
        assert not _reads_no_weights(module), module


def test_a_unit_class_that_matches_nothing_names_the_classes_there_are():
    with pytest.raises(ValueError, match=r"no module of GPT has class Blok; its module classes are .*Block"):
        find_units(gpt(), ("Blok", "Embedding"))


def test_groups_close_buckets_where_the_unit_changes():
    layout = build_layout([5, 5, 5, 5, 5], dp_size=2, bucket_numel=100, groups=[0, 0, 1, 1, 2])
    assert [b.params for b in layout.buckets] == [(0, 1), (2, 3), (4,)]
    assert all(b.world.size % 2 == 0 for b in layout.buckets)
    with pytest.raises(ValueError, match="consecutive"):
        build_layout([1, 1, 1], 1, 10, groups=[0, 1, 0])


def test_rank_zero_rendezvous_port_is_free_and_below_the_ephemeral_range():
    import socket
    from pathlib import Path

    from rayzero.workers.rank import Rank

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        ip, port = Rank.address("127.0.0.1")
        assert ip == "127.0.0.1" and max(1024, low - 12000) <= port < low
        with socket.socket() as s:
            s.bind((ip, port))  # free when handed out
