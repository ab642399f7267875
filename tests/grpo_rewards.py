"""Reward functions for the GRPO tests, TRL's signature: deterministic functions of a completion,
spread within a group so that advantages are not all zero."""


def token_sum(completions, completion_ids, **kwargs):
    """A function of the completion's ids: their sum mod 7, over 6."""
    return [(sum(ids) % 7) / 6 for ids in completion_ids]


def text_length(completions, prompts, **kwargs):
    """A function of the decoded text: its length, capped at 20, over 20; None ("cannot score")
    for an empty one."""
    return [min(len(c), 20) / 20 if c else None for c in completions]
