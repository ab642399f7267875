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


def lose_the_rollout_actor_once(completions, **kwargs):
    """0 for every completion (the weighted sum is unchanged); the first time it scores in a run
    whose RAYZERO_TEST_LOSE_ACTOR names a file not yet there, it kills the rollout actor's
    process and writes that file: the actor is lost between rounds, and the next weight sync
    finds it gone."""
    import os
    import signal
    from pathlib import Path

    mark = os.environ.get("RAYZERO_TEST_LOSE_ACTOR")
    if mark and not Path(mark).exists():
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and (d / "cmdline").read_bytes().startswith(b"ray::RolloutWorker"):
                    os.kill(int(d.name), signal.SIGKILL)
                    Path(mark).write_text(d.name)
            except OSError:
                pass
    return [0.0] * len(completions)
