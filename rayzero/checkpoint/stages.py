"""The whole model from its pipeline stages: what the driver records and checkpoints keep.

With pipeline parallelism each stage builds part of the model, under the model's own names,
and reports its part alone (`Rank.setup`: `params`, counts, FLOPs, `layout`). A name may sit
in two stages: a tied embedding is the first stage's input and a copy of it the last stage's
head, with the same values. `whole_build` joins the stages' reports into the one a run without
stages would give; the manifest's `layout` then holds every stage's layout under `stages`, and
`SavedIndex` (shards.py) reads each shard through its stage's. Pure python: no torch.

    stage (pp_rank)   params                                   layout
    0                 wte.weight, wpe.weight, blocks.0-1.*     layout["stages"][0] (= layout, less "stages")
    1                 blocks.2-3.*, ln_f.*, wte.weight (head)  layout["stages"][1]

A name in several stages counts once, and is read back from the lowest stage's shards.
"""

from __future__ import annotations

import math

# A stage's own figures, kept per stage in the whole build's `stages` where its report has them.
STAGE_KEYS = ("pp_rank", "rank", "params_per_rank", "num_params", "trainable_params", "flops_per_token",
              "buffer_numel", "shard_numel", "memory", "layers")


def stage_firsts(infos: list[dict]) -> list[dict]:
    """The first report of each stage (its lowest rank's), in stage order."""
    firsts: dict[int, dict] = {}
    for info in infos:
        firsts.setdefault(info.get("pp_rank", 0), info)
    return [firsts[k] for k in sorted(firsts)]


def stage_layouts(layout: dict) -> list[dict]:
    """A manifest's layouts, one per stage in stage order (one for a run without stages)."""
    return layout.get("stages") or [layout]


def whole_build(infos: list[dict]) -> dict:
    """The whole model's build info from every rank's `Rank.setup` report (a run without
    stages: `infos[0]` itself). A name held by several stages (a tied embedding) counts once in
    `params`, `num_params` and `trainable_params`, and once in `flops_per_token`: every stage's
    figure is 6 per parameter it holds (plus attention), and a run without stages counts the
    tied weight once (its head's matmul; the embedding is a lookup), so the stages' sum less 6
    per duplicate element is the figure the same model reports unstaged. `params_per_rank`:
    the largest stage's. `memory` and the rest: stage 0's, each stage's own under `stages`."""
    stages = stage_firsts(infos)
    if len(stages) == 1:
        return infos[0]
    params: dict[str, list[int]] = {}
    frozen: set[str] = set()
    dup_all = dup_trainable = 0
    for info in stages:
        frozen |= set(info.get("frozen", []))
    for info in stages:
        for name, shape in info["params"].items():
            if name not in params:
                params[name] = shape
                continue
            n = math.prod(params[name])
            dup_all += n
            dup_trainable += n if name not in frozen else 0
    whole = dict(stages[0])
    whole.update(
        params=params,
        frozen=sorted(frozen),
        num_params=sum(i["num_params"] for i in stages) - dup_all,
        trainable_params=sum(i["trainable_params"] for i in stages) - dup_trainable,
        flops_per_token=sum(i["flops_per_token"] for i in stages) - 6.0 * dup_all,
        params_per_rank=max(i["params_per_rank"] for i in stages),
        stages=[{k: i[k] for k in STAGE_KEYS if k in i} for i in stages],
        layout={**stages[0]["layout"], "stages": [i["layout"] for i in stages]},
    )
    return whole
