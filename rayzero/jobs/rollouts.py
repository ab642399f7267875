"""Online RL's driver side made from the run's config: its prompts, reward functions and tokenizer."""

from __future__ import annotations

from rayzero.config import RootConfig


def rollouts_for(cfg: RootConfig, data_path: str, spec, rewards: tuple = (), factory=None):
    """Online RL's driver side: the prepared prompts, the reward functions (`grpo.reward_funcs`,
    then the callables given from Python), and the tokenizer that decodes the completions for
    them and says where a completion ends."""
    from rayzero.cluster.rollouts import Rollouts
    from rayzero.data.prompts import prompt_tokens, read_prompts
    from rayzero.data.tokens import TokenDataset
    from rayzero.jobs.generate import _eos_ids, _model_files, find_tokenizer
    from rayzero.rollout.engines import engine_class
    from rayzero.rollout.rewards import Rewards, load

    g = cfg.grpo
    if cfg.rollout.engine != "replay":
        cls = engine_class(cfg.rollout.engine)  # an engine of one's own that does not import: refused here
        if cfg.rollout.slots and not callable(getattr(cls, "groups", None)):
            raise ValueError(f"rollout.slots: {cfg.rollout.engine} has no `groups(groups, sampling, slots)` method "
                             "to sample in a continuous batch; leave rollout.slots at 0")
        if cfg.rollout.partial != "finish" and not callable(getattr(cls, "chain", None)):
            raise ValueError(f"rollout.partial: {cfg.rollout.engine} has no `chain(...)` method to hand unfinished "
                             "completions on to the next round's batch; leave rollout.partial=finish")
    for fn in rewards:
        if not callable(fn):
            raise ValueError(f"rewards: {fn!r} is a {type(fn).__name__}, not a function")
    funcs = [load(name) for name in g.reward_funcs] + list(rewards)
    if not funcs:
        raise ValueError("grpo.reward_funcs: no reward function; name at least one (accuracy, format, "
                         "path/to/file.py:fn or package.module:fn), or pass rewards=[fn] from Python")
    dataset = TokenDataset(data_path, storage_cfg=cfg.checkpoint)
    where = spec.model_dir(cfg.model)
    tok = find_tokenizer(where, data_path, cfg.checkpoint)
    special = set(tok.special_tokens.values())
    stops = {tok.eos_id} | {i for i in _eos_ids(_model_files(where, cfg.checkpoint)) if i in special}
    return Rollouts(cfg, read_prompts(dataset), [[int(i) for i in ids] for ids in prompt_tokens(dataset)],
                    Rewards(funcs, g.reward_weights), tok, stops, factory)
