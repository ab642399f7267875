"""Named axes from world size and dp_outer; FSDP unit discovery on the built-in GPT."""

import pytest

from rayzero.models.gpt import ModelConfig, build_model
from rayzero.sharding.fsdp import ROOT, find_units
from rayzero.sharding.layout import build_layout
from rayzero.sharding.topology import Topology


@pytest.mark.parametrize("world, outer", [(1, 1), (4, 1), (4, 2), (6, 3), (6, 2), (8, 4), (4, 4)])
def test_every_rank_is_in_exactly_one_group_per_axis(world, outer):
    for axis, size in (("shard", world // outer), ("replicate", outer)):
        groups = Topology(world, 0, outer).groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    for rank in range(world):
        t = Topology(world, rank, outer)
        shard, rep = t.my_group("shard"), t.my_group("replicate")
        assert shard[t.shard_rank] == rank and rep[t.replica_rank] == rank
        assert set(shard) & set(rep) == {rank}
        assert rank == t.replica_rank * t.dp_shard + t.shard_rank


def test_shard_groups_are_consecutive_ranks():
    assert Topology(4, 0, 2).groups("shard") == [[0, 1], [2, 3]]
    assert Topology(4, 0, 2).groups("replicate") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("world, rank, outer", [(4, 0, 3), (4, 4, 1), (3, 0, 0)])
def test_impossible_topologies_are_refused(world, rank, outer):
    with pytest.raises(ValueError):
        Topology(world, rank, outer)


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
