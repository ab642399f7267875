"""One iteration's results from any set of ranks, merged into one dict shaped like one rank's.

`Rank.evaluate` returns one dict per rank. The compiled dispatch merges a node's ranks' dicts on
that node and the driver merges the nodes' dicts, so the driver reads one result per node
instead of one per rank. `merge` is associative (and a merge of one rank's dict is that rank's
dict, lifted), so however the ranks are grouped the driver ends with what merging every rank's
dict at once gives; and a merged dict reads as a rank's does: the loss and token sums, the
slowest rank's phase times, every upload, rank 0's scalars. Pure Python: no Ray, no torch.
"""

from __future__ import annotations

# Summed over ranks (None on every rank stays None: a model without a router's loss).
SUMS = ("loss_sum", "tokens", "aux_loss_sum", "z_loss_sum", "val_loss_sum", "val_tokens", "val0_loss_sum", "val0_tokens")
# Dicts of sums, summed key by key (preference tuning's metrics: `objectives/dpo.py`).
DICT_SUMS = ("prefs", "val_prefs", "val0_prefs")
# The same on every rank, or rank 0's alone (the step's learning rate, its grad norm, whether it was skipped).
FIRST = ("rank", "step", "lr", "grad_norm", "skipped", "loss_scale", "checkpointed")
# Expert parallelism's loads (`ExpertParallel.take_loads`): the busiest expert's ratios, their
# largest over ranks; dropped pairs and all-to-all bytes, summed.
EXPERT_MAX = ("expert_load_max_over_mean", "expert_load_mean_max_over_mean")
# Times a rank reports that are part of its phases (data: of gather; torch_compile, `train.compile`'s:
# of forward, backward or evaluate), not after them: not added to its work.
PARTS = ("data", "torch_compile")


def work_s(phase_s: dict[str, float]) -> float:
    """How long a rank worked on the iteration, from the phase times it reports."""
    return sum(v for k, v in phase_s.items() if k not in PARTS)


def lift(result: dict) -> dict:
    """One rank's result in the merged form: `ranks` (how many merged), `work_s` (the slowest
    one's work, which the per-phase maxima cannot give), `ledgers` (each rank's memory ledger,
    by rank); already merged results pass through."""
    if "ranks" in result:
        return result
    out = {**result, "ranks": 1}
    if "phase_s" in result:
        out["work_s"] = work_s(result["phase_s"])
    if "memory" in result:
        out["ledgers"] = {result["rank"]: result["memory"]}
    return out


def merge(results: list[dict], ledgers: bool = True) -> dict:
    """The results of several ranks (or of merged groups of them) as one. `ledgers`: keep every
    rank's memory ledger (what the run's summary lists per rank); the element-wise maximum in
    `memory` is kept always, and is all the per-step metrics read."""
    parts = sorted((lift(r) for r in results), key=lambda r: r.get("rank", 0))
    if not parts:
        raise ValueError("no results to merge")
    first = parts[0]
    out = {k: first[k] for k in FIRST if k in first}
    out["ranks"] = sum(p["ranks"] for p in parts)
    for k in SUMS:
        values = [p[k] for p in parts if k in p]
        if values:
            out[k] = None if all(v is None for v in values) else sum(v for v in values if v is not None)
    for k in DICT_SUMS:
        dicts = [p[k] for p in parts if k in p]
        if dicts:
            out[k] = {}
            for d in dicts:
                for name, v in d.items():
                    out[k][name] = out[k].get(name, 0.0) + v
    if all("phase_s" in p for p in parts):
        phase_s: dict[str, float] = {}
        for p in parts:
            for k, v in p["phase_s"].items():
                phase_s[k] = max(v, phase_s.get(k, v))
        out["phase_s"] = phase_s
        out["work_s"] = max(p["work_s"] for p in parts)
    loads = [p["experts"] for p in parts if p.get("experts")]
    if loads:
        out["experts"] = {k: (max if k in EXPERT_MAX else sum)(d[k] for d in loads) for k in loads[0]}
    if all("done_at" in p for p in parts):
        out["done_at"] = max(p["done_at"] for p in parts)
    if any("uploads" in p for p in parts):
        out["uploads"] = [u for p in parts for u in p.get("uploads", [])]
    memories = [p["memory"] for p in parts if "memory" in p]
    if memories:
        out["memory"] = {k: max(m.get(k, 0) for m in memories) for k in dict.fromkeys(k for m in memories for k in m)}
    if ledgers and all("ledgers" in p for p in parts):
        out["ledgers"] = {r: m for p in parts for r, m in p["ledgers"].items()}
    return out


def per_rank_ledgers(result: dict) -> list[dict] | None:
    """Each rank's memory ledger, in rank order, if the merge kept them."""
    ledgers = result.get("ledgers")
    return [ledgers[r] for r in sorted(ledgers)] if ledgers is not None else None
