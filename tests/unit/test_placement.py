"""A tensor-parallel group must land on one node: the placement is checked once the bundles
are reserved, and a group split across nodes is refused by name (Ray's placement calls stubbed)."""

import pytest

from rayzero.cluster import spares, worker_group
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
        for module in (worker_group, spares):  # (spares.remove_groups gives a group back)
            monkeypatch.setattr(module, "placement_group_table",  # as Ray's table shows a group, removed or not
                                lambda g: {"bundles_to_node_id": dict(enumerate(g.nodes)),
                                           "state": "REMOVED" if g in removed else "CREATED"})
            monkeypatch.setattr(module, "remove_placement_group", removed.append)
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


class FakeSpare:
    """A spare actor class: records the spares started and answers `warm` with a token."""

    started: list = []

    @classmethod
    def options(cls, **options):
        cls.started.append(options)
        return cls

    @classmethod
    def remote(cls, *args):
        assert args[1] is None, "a spare starts with no rank"
        return cls()

    class warm:
        @staticmethod
        def remote():
            return "warmed"


@pytest.fixture
def cluster_of(monkeypatch):
    """A stubbed cluster with room for `free` single-bundle placement groups."""
    removed = []

    def make(free: int):
        placed = []

        def get(ref, timeout=None):
            if len(placed) > free:
                raise worker_group.GetTimeoutError()

        def group(bundles, strategy="PACK"):
            pg = Placed(["a"] * len(bundles))
            placed.append(pg)
            return pg

        for module in (worker_group, spares):  # a worker group's placement calls, and the spares'
            monkeypatch.setattr(module, "placement_group", group)
            monkeypatch.setattr(module, "remove_placement_group", removed.append)
            monkeypatch.setattr(module, "placement_group_table", lambda g: {"state": "REMOVED"})
        monkeypatch.setattr(worker_group.ray, "get", get)
        monkeypatch.setattr(worker_group.ray, "kill", lambda actor, no_restart=True: None)
        FakeSpare.started = []
        return placed

    return make, removed


def test_spares_beyond_the_free_resources_are_left_out_with_one_warning(cluster_of, caplog):
    make, removed = cluster_of
    placed = make(free=1)
    pool = spares.Spares.start(FakeSpare, 3, {"CPU": 1}, lambda: ("cfg", None, 2, "data"), wait_s=0.1)
    assert len(pool) == 1 and len(FakeSpare.started) == 1
    assert removed == [placed[1]], "the group that could not be placed is given back; no third is tried"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["failure.spares=3: only 1 of 3 spares could be placed (1 CPU each); the cluster has no "
                        "free resources for more, and a lost rank beyond them restarts every rank"]


def test_all_spares_placed_warn_nothing(cluster_of, caplog):
    make, _ = cluster_of
    make(free=2)
    assert len(spares.Spares.start(FakeSpare, 2, {"CPU": 1}, lambda: ("cfg", None, 2, "data"))) == 2
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_replaced_rank_leaves_its_bundle_vacant_and_its_spare_group_is_kept(cluster_of):
    make, removed = cluster_of
    make(free=9)
    group = worker_group.WorkerGroup(["a0", "a1"], "main")
    group.replace(1, "s1", "spare-pg")
    assert group.actors == ["a0", "s1"] and group.vacant_bundle() == ("main", 1) and group.vacant_bundle() is None
    group.replace(1, "s2", "main", bundle_index=1)  # a spare started in the vacant bundle
    assert removed == ["spare-pg"], "the first spare's own group goes with it"
    group.replace(0, "s3", "pg3")
    group.kill()
    assert removed == ["spare-pg", "pg3", "main"], "kill removes every group the worker group holds"


@pytest.mark.parametrize("bundle,total,free,says", [
    ({"CPU": 1.0}, {"CPU": 8.0}, {"CPU": 2.0},
     "they need 4 CPU; the cluster has 2 of 8 CPU free. Use fewer workers (cluster.num_workers), a smaller "
     "cluster.cpus_per_worker or a cluster with more CPU."),
    ({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0}, {"CPU": 8.0},
     "they need 4 CPU, 4 GPU; the cluster has 8 of 8 CPU free, 0 of 0 GPU free. Use fewer workers "
     "(cluster.num_workers) or a cluster with more GPU."),
    ({"CPU": 1.0}, {"CPU": 8.0}, {"CPU": 8.0},  # enough in all, not on the nodes the strategy needs
     "the cluster has 8 of 8 CPU free. Use another cluster.placement_strategy or more nodes."),
])
def test_a_placement_that_never_comes_says_what_is_free_and_what_is_short(monkeypatch, bundle, total, free, says):
    monkeypatch.setattr(worker_group.ray, "cluster_resources", lambda: total)
    monkeypatch.setattr(worker_group.ray, "available_resources", lambda: free)
    said = worker_group.unplaced(4, bundle, "PACK", 60)
    assert said.startswith(f"could not place cluster.num_workers=4 workers of {bundle} each (strategy PACK) within "
                           "cluster.placement_timeout_s=60s") and said.endswith(says), said
