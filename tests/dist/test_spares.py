"""A rank leaves a broken group and a warm spare takes the lost rank's place, on real gloo
groups: both set up again at a new rendezvous, resume from the commit, and end bitwise equal to
the unbroken run, with no reader, upload or gloo thread, and none of the first group's model or
buffers, left over from the first group."""

import gc
import threading
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayzero.checkpoint.manifest import open_checkpoint
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.cluster.schedule import lr_at
from tests.conftest import free_port
from tests.dist.ckpt_helpers import config, run
from tests.dist.pool import spawn

COMMIT_AT, FAIL_AFTER, STEPS = 4, 6, 8  # commit after step 3; the failure after step 5


def _plan(cfg, k: int, ckpt: Checkpoints | None = None) -> dict:
    plan = {"step": k, "lr": lr_at(k, cfg.train.steps, cfg.optim)}
    if ckpt is not None and k + 1 == COMMIT_AT:
        plan["checkpoint"] = {"uri": ckpt.root.child(f"step-{COMMIT_AT:06d}").uri, "step": COMMIT_AT}
    return plan


def _ours() -> list[str]:
    """This process's data-reader and checkpoint-upload threads."""
    return [t.name for t in threading.enumerate() if t.name.startswith(("rayzero-data", "ckpt-upload"))]


def _gloo_threads() -> int:
    """This process's gloo threads (a process group's workers and its connections' loop)."""
    import os

    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return sum(n.startswith(("pt_gloo", "gloo_")) for n in names)


def _rank(rank, world, cfg, data_path, ports, out):
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    gc.collect()  # what jobs before this one in the kept process left for the collector goes first
    gloo_before = _gloo_threads()
    r = Rank(cfg, rank, world, data_path)
    info = r.setup("127.0.0.1", ports[0])
    ckpt = Checkpoints(cfg)
    uploads = []  # reported by the steps after the save, and by the wait for the last upload
    for k in range(FAIL_AFTER):
        res = r.iteration(_plan(cfg, k, ckpt))
        uploads += res["uploads"]
        if k + 1 == COMMIT_AT:
            saved = res
    uploads += r.finish_checkpoints()
    # The controller's commit, on rank 0, from every rank's report.
    reports = [None] * world
    dist.all_gather_object(reports, (info, saved, uploads))
    if rank == 0:
        ckpt.configure([i for i, _, _ in reports], mlflow_run_id=None)
        # `uploads` holds every report, the saving step's own too (an upload that ends at once)
        ckpt.collect(COMMIT_AT - 1, [{**s, "uploads": []} for _, s, _ in reports])
        ckpt.add_uploads([u for _, _, us in reports for u in us])
    where = [ckpt.last_committed if rank == 0 else None]
    dist.broadcast_object_list(where)

    # The failure: rank 0 survives and leaves its group; rank 1 is replaced by a warm spare.
    first_group = weakref.ref(r.strategy)
    left = r.leave(upload_wait_s=5.0)
    assert left["rank"] == rank and left["uploads"] == []
    assert not dist.is_initialized() and r.model is None and r.saver is None
    # what the first group built is freed with it: its buffers, and its process groups' threads
    assert first_group() is None and _gloo_threads() == gloo_before, (first_group(), _gloo_threads(), gloo_before)
    if rank == 1:
        r = Rank(cfg, None, world, data_path)
        assert r.progress()["rank"] is None
        r.warm()
        r.assign(1, world)
    assert _ours() == [], _ours()
    r.setup("127.0.0.1", ports[1])
    c = open_checkpoint(where[0])
    r.load_checkpoint(c.uri, c.manifest)
    r.apply_checkpoint()
    for k in range(COMMIT_AT, STEPS):
        r.iteration(_plan(cfg, k))
    state = r.full_state_dict()
    out[rank] = {"state": state, "committed": where[0], "threads": _ours()}
    r.close()


def test_a_survivor_and_a_spare_resume_bitwise(tmp_path, small_dataset):
    cfg = config(2, "optim", str(tmp_path / "ckpt"), ["train.steps=8"])
    straight = run(cfg, small_dataset, 0, STEPS)
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_rank, args=(2, cfg, small_dataset, (free_port(), free_port()), out), nprocs=2)
        out = {r: out[r] for r in range(2)}
    assert out[0]["committed"].endswith(f"step-{COMMIT_AT:06d}")
    assert all(len([t for t in out[r]["threads"] if t.startswith("rayzero-data")]) <= 1 for r in out)
    for name, ref in straight["state"].items():
        assert torch.equal(out[0]["state"][name], ref), name


def _stuck(rank, world, ports, events):
    """Rank 0 waits in an all-reduce that rank 1 (alive) never joins, as a survivor waits on a
    peer that gave up on the collective; cutting rank 0's group connections ends the wait at
    once, long before the group's timeout, and a new group forms in the same processes."""
    from datetime import timedelta

    from rayzero.workers.disconnect import break_group, opened_while

    sockets: set[int] = set()
    with opened_while(sockets):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(4))  # the group works
    if rank == 0:
        caught = []

        def stuck():
            try:
                dist.all_reduce(torch.ones(1000))
            except RuntimeError as e:
                caught.append(str(e))

        t = threading.Thread(target=stuck)
        t.start()
        t.join(1.0)
        assert t.is_alive(), "rank 1 never joins this all-reduce: it waits"
        assert break_group(sockets) > 0
        t.join(60)
        events["before_the_peer_moved"] = "peer_moved" not in events  # rank 1 moves only once freed is set
        events["freed"] = not t.is_alive() and bool(caught)
    else:
        for _ in range(600):  # absent from the collective until rank 0 is free (or a minute)
            if "freed" in events:
                break
            threading.Event().wait(0.1)
        events["peer_moved"] = True
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    t = torch.ones(4)
    dist.all_reduce(t)
    events[f"again{rank}"] = t.tolist()
    dist.destroy_process_group()


def test_cutting_a_groups_connections_frees_a_rank_stuck_in_a_collective_with_a_live_peer():
    with mp.Manager() as manager:
        events = manager.dict()
        spawn(_stuck, args=(2, (free_port(), free_port()), events), nprocs=2)
        events = dict(events)
    assert events["freed"] and events["before_the_peer_moved"], events
    assert events["again0"] == events["again1"] == [2.0] * 4
