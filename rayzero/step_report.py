"""A step's report: what each rank returns from an iteration, every key declared here once with
how it merges, and the one merge that makes several ranks' (or merged nodes') reports one.

`Rank.evaluate` returns one report per rank. The compiled dispatch merges a node's ranks' reports
on that node and the driver merges the nodes', so the driver reads one result per node instead of
one per rank. `merge` is associative (and a merge of one rank's report is that report, lifted),
so however the ranks are grouped the driver ends with what merging every rank's at once gives;
and a merged report reads as a rank's does. A key not declared in `FIELDS` is an error, never
dropped. Pure Python: no Ray, no torch; the ranks and the driver both import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _sum_or_none(values: list):
    """Summed; None where every rank has None (a model without a router's loss)."""
    return None if all(v is None for v in values) else sum(v for v in values if v is not None)


def _max_by_key(values: list[dict]) -> dict:
    """Each key's largest value over the ranks that have it (the keys of any)."""
    return {k: max(d[k] for d in values if k in d) for k in dict.fromkeys(k for d in values for k in d)}


def _ledger_max(values: list[dict]) -> dict:
    """Each ledger entry's largest over the ranks, 0 where a rank has none."""
    return {k: max(d.get(k, 0) for d in values) for k in dict.fromkeys(k for d in values for k in d)}


def _objective(values: list[dict]) -> dict:
    """An objective's metrics ({"sum": ..., "max": ...}, `objectives/base.py`'s `Metric`): sums
    added key by key, maxima taken key by key."""
    out: dict = {"sum": {}, "max": {}}
    for d in values:
        for k, v in d.get("sum", {}).items():
            out["sum"][k] = out["sum"].get(k, 0.0) + v
        for k, v in d.get("max", {}).items():
            out["max"][k] = max(out["max"][k], v) if k in out["max"] else v
    return out


# Expert parallelism's loads (`ExpertParallel.take_loads`): the busiest expert's ratios, their
# largest over ranks; dropped pairs and all-to-all bytes, summed.
EXPERT_MAX = ("expert_load_max_over_mean", "expert_load_mean_max_over_mean")


def _experts(values: list[dict]) -> dict | None:
    """None (the key left out) where no rank dispatched to experts."""
    loads = [v for v in values if v]
    if not loads:
        return None
    return {k: (max if k in EXPERT_MAX else sum)(d[k] for d in loads) for k in loads[0]}


def _first(values: list):
    return values[0]


@dataclass(frozen=True)
class Field:
    """One key of a step's report: how the ranks' values merge (`merge`, given every present
    value in rank order), and whether the merged report has it only when every rank's has it
    (`all_ranks`) rather than when any has."""

    merge: Callable[[list], object]
    all_ranks: bool = False
    doc: str = ""
    optional: bool = False  # a merge of None leaves the key out


FIELDS: dict[str, Field] = {
    # the same on every rank, or rank 0's alone
    "rank": Field(_first, doc="the lowest rank merged"),
    "step": Field(_first), "lr": Field(_first), "grad_norm": Field(_first), "skipped": Field(_first),
    "loss_scale": Field(_first), "checkpointed": Field(_first),
    # summed over ranks
    "loss_sum": Field(_sum_or_none, doc="the objective's loss, summed as the step divides it"),
    "tokens": Field(_sum_or_none, doc="what the loss is divided by: valid targets, pairs, ..."),
    "aux_loss_sum": Field(_sum_or_none), "z_loss_sum": Field(_sum_or_none),
    "val_loss_sum": Field(_sum_or_none), "val_tokens": Field(_sum_or_none),
    "val0_loss_sum": Field(_sum_or_none), "val0_tokens": Field(_sum_or_none),
    "ranks": Field(sum, doc="how many ranks' reports are merged in"),
    # the objective's metrics, each merged as it declares (`objectives/base.py`)
    "objective": Field(_objective), "val_objective": Field(_objective), "val0_objective": Field(_objective),
    # the slowest rank's
    "phase_s": Field(_max_by_key, all_ranks=True, doc="seconds in each phase"),
    "work_s": Field(max, all_ranks=True, doc="the slowest rank's whole work"),
    "done_at": Field(max, all_ranks=True, doc="when the last rank finished, on its clock"),
    "memory": Field(_ledger_max, doc="the memory ledger, each entry's largest"),
    "ledgers": Field(lambda vs: {r: m for v in vs for r, m in v.items()}, all_ranks=True,
                     doc="each rank's ledger, by rank"),
    "uploads": Field(lambda vs: [u for v in vs for u in v], doc="every checkpoint upload reported"),
    "experts": Field(_experts, doc="expert parallelism's loads", optional=True),
}

# Times a rank reports that are part of its phases (data: of gather; torch_compile, `train.compile`'s:
# of forward, backward or evaluate), not after them: not added to its work.
PARTS = ("data", "torch_compile")


def work_s(phase_s: dict[str, float]) -> float:
    """How long a rank worked on the iteration, from the phase times it reports."""
    return sum(v for k, v in phase_s.items() if k not in PARTS)


def lift(result: dict) -> dict:
    """One rank's report in the merged form: `ranks` (how many merged), `work_s` (the slowest
    one's work, which the per-phase maxima cannot give), `ledgers` (each rank's memory ledger,
    by rank); already merged reports pass through."""
    if "ranks" in result:
        return result
    out = {**result, "ranks": 1}
    if "phase_s" in result:
        out["work_s"] = work_s(result["phase_s"])
    if "memory" in result:
        out["ledgers"] = {result["rank"]: result["memory"]}
    return out


def undeclared(result: dict) -> list[str]:
    """The keys of a report that `FIELDS` does not declare."""
    return [k for k in result if k not in FIELDS]


def merge(results: list[dict], ledgers: bool = True) -> dict:
    """The reports of several ranks (or of merged groups of them) as one. `ledgers`: keep every
    rank's memory ledger (what the run's summary lists per rank); the element-wise maximum in
    `memory` is kept always, and is all the per-step metrics read. A key no field declares is a
    ValueError."""
    parts = sorted((lift(r) for r in results), key=lambda r: r.get("rank", 0))
    if not parts:
        raise ValueError("no results to merge")
    odd = sorted({k for p in parts for k in undeclared(p)})
    if odd:
        raise ValueError(f"a step's report has keys no field declares: {', '.join(odd)} (declare each in "
                         "rayzero/step_report.py's FIELDS with its merge)")
    out = {}
    for key, f in FIELDS.items():
        if key == "ledgers" and not ledgers:
            continue
        values = [p[key] for p in parts if key in p]
        if not values or (f.all_ranks and len(values) != len(parts)):
            continue
        merged = f.merge(values)
        if merged is not None or not f.optional:
            out[key] = merged
    return out


def per_rank_ledgers(result: dict) -> list[dict] | None:
    """Each rank's memory ledger, in rank order, if the merge kept them."""
    ledgers = result.get("ledgers")
    return [ledgers[r] for r in sorted(ledgers)] if ledgers is not None else None
