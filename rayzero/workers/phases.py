"""The calls a rank answers, in the order it goes through them: the one list that the rank,
its actor, the controller's dispatch, its watchdog and the run's history all read.

    setup → [load_checkpoint → apply_checkpoint] → iterations … → [finish_checkpoints] → [full_state_dict]

    one iteration:  gather → (forward → backward) x micro-batches → reduce_scatter → step → evaluate
"""

from __future__ import annotations

ITERATION = ("gather", "forward", "backward", "reduce_scatter", "step", "evaluate")
MICRO_BATCH = ("forward", "backward")  # run once per micro-batch, in this order
BEFORE = ("setup", "load_checkpoint", "apply_checkpoint")
AFTER = ("finish_checkpoints", "full_state_dict")
CALLS = (*BEFORE, *ITERATION, *AFTER)  # a rank's calls in order: who is behind whom


def iteration(num_microbatches: int) -> list[str]:
    """The phases of one iteration of `num_microbatches` micro-batches, in the order they run."""
    first, after = ITERATION.index(MICRO_BATCH[0]), ITERATION.index(MICRO_BATCH[-1]) + 1
    return [*ITERATION[:first], *MICRO_BATCH * num_microbatches, *ITERATION[after:]]
