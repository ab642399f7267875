"""Merging one iteration's results: any grouping of the ranks reads as the flat per-rank reading."""

import itertools
import random

from rayzero.step_report import merge, per_rank_ledgers, work_s


def rank_result(rank: int, rng: random.Random, evaluate: bool = True) -> dict:
    # dyadic values (multiples of 1/8): their sums are exact in any order
    out = {"rank": rank, "step": 7, "lr": 1e-3 * (rank + 1), "loss_sum": rng.randrange(1000) / 8,
           "tokens": rng.randrange(100, 200), "aux_loss_sum": None, "grad_norm": 2.0 + rank, "skipped": rank == 3,
           "loss_scale": None, "checkpointed": True,
           "memory": {"total": rng.randrange(10**6), "transient_peak": rng.randrange(10**5), "activations_peak": 0},
           "phase_s": {"gather": rng.randrange(8) / 8, "data": rng.randrange(8) / 8, "forward": rng.randrange(8) / 8,
                       "step": rng.randrange(8) / 8},
           "uploads": [{"rank": rank, "step": 8}] if rank % 2 == 0 else [], "done_at": 100.0 + rng.randrange(8) / 8,
           "experts": {"expert_load_max_over_mean": 1 + rng.randrange(8) / 8,
                       "expert_load_mean_max_over_mean": 1 + rng.randrange(8) / 8,
                       "dropped_pairs": float(rng.randrange(5)), "alltoall_bytes": float(rng.randrange(1000))}}
    if evaluate:
        out.update(val_loss_sum=rng.randrange(100) / 8, val_tokens=rng.randrange(10, 20))
    return out


def flat_reading(results: list[dict]) -> dict:
    """What the controller read from one dict per rank before the merge."""
    return {"loss_sum": sum(r["loss_sum"] for r in results), "tokens": sum(r["tokens"] for r in results),
            "val_loss_sum": sum(r["val_loss_sum"] for r in results), "val_tokens": sum(r["val_tokens"] for r in results),
            "phase_s": {p: max(r["phase_s"][p] for r in results) for p in results[0]["phase_s"]},
            "work_s": max(work_s(r["phase_s"]) for r in results), "done_at": max(r["done_at"] for r in results),
            "uploads": sorted(u["rank"] for r in results for u in r["uploads"]),
            "memory_max": {k: max(r["memory"][k] for r in results) for k in results[0]["memory"]},
            "ledgers": [r["memory"] for r in results], "first": {k: results[0][k] for k in ("lr", "grad_norm", "skipped")},
            "experts": {k: (max if k.startswith("expert_load") else sum)(r["experts"][k] for r in results)
                        for k in results[0]["experts"]}}


def reading(m: dict) -> dict:
    return {"loss_sum": m["loss_sum"], "tokens": m["tokens"], "val_loss_sum": m["val_loss_sum"],
            "val_tokens": m["val_tokens"], "phase_s": m["phase_s"], "work_s": m["work_s"], "done_at": m["done_at"],
            "uploads": sorted(u["rank"] for u in m["uploads"]), "memory_max": m["memory"],
            "ledgers": per_rank_ledgers(m), "first": {k: m[k] for k in ("lr", "grad_norm", "skipped")},
            "experts": m["experts"]}


def test_merged_per_node_reads_as_every_rank_read_flat():
    rng = random.Random(0)
    results = [rank_result(r, rng) for r in range(8)]
    for per_node in (1, 2, 4, 8):
        nodes = [merge(results[i:i + per_node]) for i in range(0, 8, per_node)]
        rng.shuffle(nodes)  # the driver may read the nodes in any order
        m = merge(nodes)
        assert m["ranks"] == 8 and m["rank"] == 0
        assert reading(m) == flat_reading(results)


def test_the_merge_is_associative_whatever_the_grouping():
    rng = random.Random(1)
    a, b, c, d = (rank_result(r, rng) for r in (2, 0, 3, 1))
    whole = merge([a, b, c, d])
    for x, y, z in itertools.permutations([merge([a, b]), c, d]):
        assert merge([merge([x, y]), z]) == merge([x, merge([y, z])]) or \
            reading(merge([merge([x, y]), z])) == reading(whole)
    assert reading(merge([merge([a, c]), merge([b, d])])) == reading(whole)  # interleaved nodes too


def test_one_rank_merged_is_that_rank_lifted():
    rng = random.Random(2)
    r = rank_result(5, rng)
    m = merge([r])
    assert {k: m[k] for k in r if k != "memory"} == {k: r[k] for k in r if k != "memory"}
    assert m["ranks"] == 1 and m["work_s"] == work_s(r["phase_s"]) and per_rank_ledgers(m) == [r["memory"]]


def test_ledgers_are_dropped_when_not_asked_for_but_the_maximum_stays():
    rng = random.Random(3)
    results = [rank_result(r, rng) for r in range(4)]
    m = merge([merge(results[:2], ledgers=False), merge(results[2:])])
    assert "ledgers" not in m and per_rank_ledgers(m) is None
    assert m["memory"] == {k: max(r["memory"][k] for r in results) for k in results[0]["memory"]}


def test_sums_absent_or_none_stay_so():
    rng = random.Random(4)
    m = merge([rank_result(0, rng, evaluate=False), rank_result(1, rng, evaluate=False)])
    assert "val_loss_sum" not in m and m["aux_loss_sum"] is None
