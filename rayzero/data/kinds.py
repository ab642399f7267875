"""Which batches read a dataset of each kind (`meta.json`'s `kind`): the one place a rank looks it up."""

from __future__ import annotations

from rayzero.data.batches import DocumentBatches, RankBatches
from rayzero.data.instruct import InstructionBatches
from rayzero.data.preferences import PreferenceBatches
from rayzero.data.rollouts import RolloutBatches


def batches_for(dataset, document_masking: bool = False) -> type:
    """Text: windows at seeded offsets (with `document_masking`, each document in a window
    alone); instruction examples: packed windows with masked labels, each example alone;
    preference pairs: a pair's chosen and rejected in two rows, masked labels; prompts: the
    rollouts of their completions that each step's plan brings (online RL)."""
    if dataset.kind == "prompts":
        return RolloutBatches
    if dataset.kind == "preferences":
        return PreferenceBatches
    if dataset.kind == "instructions":
        return InstructionBatches
    return DocumentBatches if document_masking else RankBatches
