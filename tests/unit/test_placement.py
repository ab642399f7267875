"""A tensor-parallel group must land on one node: the placement is checked once the bundles
are reserved, and a group split across nodes is refused by name (Ray's placement calls stubbed)."""

import pytest

from rayzero.cluster import worker_group
from rayzero.cluster.worker_group import PlacementError


class Placed:
    def __init__(self, nodes):
        self.nodes = nodes

    def ready(self):
        return None


@pytest.fixture
def placed(monkeypatch):
    removed = []

    def place(nodes):
        pg = Placed(nodes)
        monkeypatch.setattr(worker_group, "placement_group", lambda bundles, strategy: pg)
        monkeypatch.setattr(worker_group.ray, "get", lambda ref, timeout=None: None)
        monkeypatch.setattr(worker_group, "placement_group_table",
                            lambda g: {"bundles_to_node_id": dict(enumerate(g.nodes))})
        monkeypatch.setattr(worker_group, "remove_placement_group", removed.append)
        return pg

    return place, removed


class NoActor:
    @staticmethod
    def options(**_):
        raise AssertionError("no actor may start on a refused placement")


def test_a_tensor_parallel_group_split_across_nodes_is_refused_by_name(placed):
    place, removed = placed
    pg = place(["a", "a", "a", "b"])
    with pytest.raises(PlacementError, match=r"parallel.tp=2: the ranks of tensor-parallel group\(s\) \[\[2, 3\]\] "
                                             r"were placed on different nodes"):
        worker_group.WorkerGroup.create(NoActor, 4, {"CPU": 1}, lambda r: (), same_node=2)
    assert removed == [pg], "the reserved bundles are given back"


def test_groups_each_on_one_node_pass_the_check(placed):
    place, _ = placed
    place(["a", "a", "b", "b"])
    with pytest.raises(AssertionError, match="no actor may start"):  # past the check: the actors start
        worker_group.WorkerGroup.create(NoActor, 4, {"CPU": 1}, lambda r: (), same_node=2)
