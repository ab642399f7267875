"""Reward functions for the GRPO tests, TRL's signature: deterministic functions of a completion,
spread within a group so that advantages are not all zero."""


def token_sum(completions, completion_ids, **kwargs):
    """A function of the completion's ids: their sum mod 7, over 6."""
    return [(sum(ids) % 7) / 6 for ids in completion_ids]


def text_length(completions, prompts, **kwargs):
    """A function of the decoded text: its length, capped at 20, over 20; None ("cannot score")
    for an empty one."""
    return [min(len(c), 20) / 20 if c else None for c in completions]


def flat_on_sky(completions, prompts, completion_ids, **kwargs):
    """The same reward for every completion of a prompt about the sky (a group without an
    advantage: dynamic sampling drops it), `token_sum`'s elsewhere."""
    return [0.5 if "sky" in p else (sum(ids) % 7) / 6 for p, ids in zip(prompts, completion_ids)]
