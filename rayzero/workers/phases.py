"""The calls a rank answers, in the order it goes through them: the one list that the rank,
its actor, the controller's dispatch, its watchdog and the run's history all read.

    setup → [load_checkpoint → apply_checkpoint] → iterations … → [finish_checkpoints] → [full_state_dict]

    one iteration:  gather → (forward → backward) x micro-batches → reduce_grads → step → evaluate
    with stages:    gather → pipeline (the schedule's forwards and backwards) → reduce_grads → step → evaluate
"""

from __future__ import annotations

ITERATION = ("gather", "forward", "backward", "reduce_grads", "step", "evaluate")
MICRO_BATCH = ("forward", "backward")  # run once per micro-batch, in this order
BEFORE = ("setup", "load_checkpoint", "apply_checkpoint")
AFTER = ("finish_checkpoints", "full_state_dict")
PIPELINE = "pipeline"  # with pipeline stages: every micro-batch's forward and backward, in the schedule's order
CALLS = (*BEFORE, *ITERATION, PIPELINE, *AFTER)  # a rank's calls in order: who is behind whom


def iteration(num_microbatches: int, staged: bool = False) -> list[str]:
    """The phases of one iteration of `num_microbatches` micro-batches, in the order they run
    (`staged`: with pipeline stages, the micro-batches' in one phase, as the pipeline's schedule orders them)."""
    first, after = ITERATION.index(MICRO_BATCH[0]), ITERATION.index(MICRO_BATCH[-1]) + 1
    middle = [PIPELINE] if staged else [*MICRO_BATCH * num_microbatches]
    return [*ITERATION[:first], *middle, *ITERATION[after:]]

