"""Which batches read a dataset of each kind (`meta.json`'s `kind`): the one place a rank looks it up."""

from __future__ import annotations

from rayzero.data.batches import RankBatches
from rayzero.data.instruct import InstructionBatches
from rayzero.data.preferences import PreferenceBatches


def batches_for(dataset) -> type:
    """Text: windows at seeded offsets; instruction examples: packed windows with masked labels;
    preference pairs: a pair's chosen and rejected in two rows, masked labels."""
    if dataset.kind == "preferences":
        return PreferenceBatches
    if dataset.kind == "instructions":
        return InstructionBatches
    return RankBatches
