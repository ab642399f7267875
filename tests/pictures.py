"""The pictures of docs/concepts/architecture.md that the code draws: the mesh of an 8-rank run
(`Mesh.describe`, what `--dry-run` prints) and each pipeline schedule's timeline
(`simulate(...).draw()`, the simulator the schedule tests check against the bubble formula).
Kept equal to the page by tests/unit/test_docs.py; `python -m tests.pictures` prints them."""

from rayzero.pipeline.schedules import bubble_formula, schedule, simulate
from rayzero.sharding.mesh import Mesh

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1))
P, M = 4, 8  # stages, micro-batches


def pictures_block() -> str:
    mesh = Mesh(world_size=8, pp=2, tp=2)
    lines = ["`parallel.pp=2 parallel.tp=2` on 8 ranks (the data-parallel `shard` axis takes the rest):", "",
             "```text", *mesh.describe(), "```", "",
             f"Each schedule at {P} stages and {M} micro-batches, one row per pipeline rank, one character per "
             "unit of time (a forward F costs 1, a backward B 2, its input and weight parts I and W 1 each; "
             "`.` is idle; interleaved's rows hold each rank's two chunks, stages r and r + 4):", ""]
    for name, v in SCHEDULES:
        timeline = simulate(schedule(name, P, M, v))
        lines += [f"`{name}`{f' (v {v})' if v > 1 else ''}: bubble {timeline.bubble(0):.3f} of the compute "
                  f"(formula {bubble_formula(name, P, M, v):.3f})", "", "```text",
                  timeline.draw(), "```", ""]
    return "\n".join(lines).rstrip("\n")


if __name__ == "__main__":
    print(pictures_block())
