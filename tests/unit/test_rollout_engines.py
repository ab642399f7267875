"""The rollout engines (`rayzero/rollout/engines.py`) on a tiny Llama: greedy sampling is
transformers' own `generate`; each token's log-probability is the tempered distribution's, as a
whole forward of the prompt and completion gives it; top-k keeps to the k likeliest; a
completion's draws are a function of its seed alone (the same group sampled again, by another
engine, is the same; another round is not); it stops at an end id or at max_completion_length,
and says which. The replay engine reads recorded rounds in the file's order and refuses what
does not match, in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rayzero.rollout.engines import ReplayEngine, Sampling, TransformersEngine, draw_seed
from tests.models import hf_config

PROMPT = [3, 17, 42, 9, 5]
EOS = 2


@pytest.fixture(scope="module")
def model():
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32).eval()


def whole_logps(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(completion)[:, None])[:, 0], logits


def test_greedy_sampling_is_transformers_generate(model):
    got = TransformersEngine(model, (EOS,)).group(PROMPT, [1, 2], Sampling(top_k=1, max_completion_length=12))
    want = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12, eos_token_id=EOS,
                          pad_token_id=EOS)[0, len(PROMPT):].tolist()
    assert got[0].ids == got[1].ids == want[: len(got[0].ids)]


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.7, max_completion_length=10),
                                      Sampling(temperature=1.3, top_k=2, max_completion_length=10),
                                      Sampling(top_p=0.5, max_completion_length=10)])
def test_each_tokens_logp_is_the_tempered_distributions_and_the_filters_hold(model, sampling):
    seeds = [draw_seed(0, 0, 7, i) for i in range(3)]
    for c in TransformersEngine(model, (EOS,)).group(PROMPT, seeds, sampling):
        want, logits = whole_logps(model, PROMPT, c.ids, sampling.temperature)
        assert torch.allclose(torch.tensor(c.logps), want, atol=1e-5)
        if sampling.top_k:
            top = logits.topk(sampling.top_k, -1).indices
            assert all(t in top[i] for i, t in enumerate(c.ids))
        assert c.truncated == (c.ids[-1] != EOS) and (c.truncated or len(c.ids) <= sampling.max_completion_length)
        assert len(c.ids) == len(c.logps) <= sampling.max_completion_length


def test_a_completion_is_a_function_of_its_seed_alone(model):
    s = Sampling(max_completion_length=8)
    seeds = [draw_seed(3, 5, 11, i) for i in range(4)]
    a = TransformersEngine(model, (EOS,)).group(PROMPT, seeds, s)
    b = TransformersEngine(model, (EOS,)).group(PROMPT, seeds, s)  # another engine: the same draws
    assert [c.ids for c in a] == [c.ids for c in b] and [c.logps for c in a] == [c.logps for c in b]
    assert len({tuple(c.ids) for c in a}) > 1, "the group's completions differ from one another"
    other = TransformersEngine(model, (EOS,)).group(PROMPT, [draw_seed(3, 6, 11, i) for i in range(4)], s)
    assert [c.ids for c in other] != [c.ids for c in a]  # another round draws anew
    assert len({draw_seed(0, r, p, i) for r in range(3) for p in range(3) for i in range(3)}) == 27


def test_the_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="temperature: 0 must be > 0"):
        Sampling(temperature=0)
    with pytest.raises(ValueError, match="top_p: 1.5 must be in"):
        Sampling(top_p=1.5)


def test_replay_reads_rounds_in_the_files_order_and_refuses_what_does_not_match(tmp_path):
    lines = [{"round": 0, "prompt": "b", "index": 1, "completion_ids": [5, 2]},
             {"round": 0, "prompt": "b", "index": 0, "completion_ids": [4, 2]},
             {"round": 0, "prompt": "a", "prompt_ids": [1, 9], "index": 0, "completion_ids": [7]},
             {"round": 0, "prompt": "a", "prompt_ids": [1, 9], "index": 1, "completion_ids": [8, 8]}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = ReplayEngine(path).round(0, 2)
    assert [(g["prompt"], g["prompt_ids"], g["completions"]) for g in got] == [
        ("b", None, [[4, 2], [5, 2]]), ("a", [1, 9], [[7], [8, 8]])]
    with pytest.raises(ValueError, match=r"has no round 1 \(it has rounds 0..0\)"):
        ReplayEngine(path).round(1, 2)
    with pytest.raises(ValueError, match=r"completions \[0, 1\], expected 0..2 \(grpo.num_generations\)"):
        ReplayEngine(path).round(0, 3)
    path.write_text(json.dumps({"round": 0, "prompt": "a", "index": 0}) + "\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:1: no 'completion_ids'"):
        ReplayEngine(path)


def test_a_rollout_actor_stages_new_weights_and_puts_them_in_between_generations(tmp_path):
    """The actor's double buffer: a version loaded while it holds another is staged, not put in;
    a generation asked for a version samples from it (the staged weights put in first), the same
    completions an engine over a model of those weights draws; an older staged version is dropped."""
    import transformers as tf

    from rayzero.config import load_config
    from rayzero.workers.rollout import RolloutWorker

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    cfg = load_config(None, ["model.kind=hf", f"model.path={tmp_path / 'm'}", "train.objective=grpo",
                             "grpo.max_completion_length=8", "rollout.cpus_per_worker=1"])
    actor = RolloutWorker(cfg, [EOS])
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    moved = {id(p): p.detach() + 0.05 * torch.randn_like(p) for n, p in model.named_parameters() if "norm" not in n}
    v1 = {k: moved[id(t)] for k, t in model.state_dict(keep_vars=True).items() if id(t) in moved}  # a tied one alike
    actor.load(0, [v0])
    actor.load(1, [v1])
    name = next(iter(v1))
    assert torch.equal(actor.model.state_dict()[name], v0[name]) and actor.version == 0  # staged, not put in
    sampling, seeds = Sampling(temperature=1.0, max_completion_length=6), [11, 12]
    job = {"prompt": 0, "ids": PROMPT, "seeds": seeds}
    first = actor.generate(0, [job], sampling, version=0)["groups"][0]
    assert first["version"] == 0
    second = actor.generate(1, [job], sampling, version=1)["groups"][0]
    assert second["version"] == 1 and torch.equal(actor.model.state_dict()[name], v1[name])
    model.load_state_dict(v1, strict=False)
    want = TransformersEngine(model.eval(), (EOS,)).group(PROMPT, seeds, sampling)
    assert [c["ids"] for c in second["completions"]] == [c.ids for c in want]
    actor.load(2, [v0])
    actor.load(3, [v1])
    actor.generate(2, [job], sampling, version=3)
    assert actor.version == 3 and not actor._staged  # version 2, never asked for, dropped


STOPS = tuple(range(2, 30))  # end ids enough that completions end at every length: a long tail


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2_moe"])
def test_a_continuous_batch_samples_the_policy_and_gives_a_finished_row_the_next_completion_at_once(arch):
    """Six groups of four, prompts of 2 to 7 tokens, through 3 rows: every token's log-probability
    is the whole forward's (left padding, positions and the spliced cache are right); each forward
    holds 3 rows while completions wait; it takes fewer forwards than a group's batch at a time
    would; a completion is the one its group's batch draws from the same seed (bar a near tie)."""
    import transformers as tf

    from rayzero.rollout.continuous import ContinuousBatch

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32).eval()
    engine, sampling = TransformersEngine(model, STOPS), Sampling(temperature=0.9, top_k=50, max_completion_length=30)
    groups = [((PROMPT + [11, 12])[:k + 2], [draw_seed(0, 0, k, i) for i in range(4)]) for k in range(6)]
    batch = ContinuousBatch(engine, 3)
    got = batch.run(groups, sampling)
    lengths = [len(c.ids) for g in got for c in g]
    assert min(lengths) < 5 and max(lengths) > 20, "a long tail, as the test means"
    for (prompt, _), done in zip(groups, got):
        for c in done:
            want, _ = whole_logps(model, prompt, c.ids, sampling.temperature)
            assert torch.allclose(torch.tensor(c.logps), want, atol=1e-5)
            assert c.truncated == (c.ids[-1] not in STOPS) and len(c.ids) <= 30
    assert all(rows == 3 for rows, waiting in batch.widths if waiting), batch.widths
    by_group = [engine.group(prompt, seeds, sampling) for prompt, seeds in groups]
    assert batch.forwards < sum(max(len(c.ids) for c in g) - 1 for g in by_group)
    same = sum(a.ids == b.ids for g, h in zip(got, by_group) for a, b in zip(g, h))
    assert same >= 22, f"{same} of 24 completions as a group's batch draws them"
    assert engine.groups(groups, sampling, 3) == got  # the engine's way in; the same draws again


@pytest.mark.parametrize("partial", ["continue", "restart"])
def test_a_chain_hands_unfinished_completions_on_to_the_next_rounds_batch_on_its_weights(partial):
    """Round 0's batch of 3 rows hands on what is still sampling once a row would be left idle
    (no forward ran short of rows); round 1's batch, on other weights, finishes those first (each
    token's logp the whole forward's of the weights that sampled it, their spans saying which)
    and hands its own on in turn; the same chain again gives the same draws."""
    import transformers as tf

    from rayzero.rollout.continuous import ContinuousBatch

    torch.manual_seed(0)
    old = tf.AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32).eval()
    new = tf.AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32).eval()
    sampling = Sampling(temperature=0.9, top_k=50, max_completion_length=30)
    rounds = [[((PROMPT + [11, 12])[:k + 2], [draw_seed(0, r, k, i) for i in range(4)]) for k in range(4)]
              for r in range(2)]

    def link(model, groups, handed, version):
        batch, done_before = ContinuousBatch(TransformersEngine(model, STOPS), 3), []
        done = batch.run(groups, sampling, handed, True, version, partial, done_before.extend)
        return batch, done, done_before

    first, done0, none = link(old, rounds[0], [], 0)
    assert none == [] and first.handed_on and all(rows == 3 for rows, _ in first.widths), first.widths
    assert sum(c is None for g in done0 for c in g) == len(first.handed_on)
    second, done1, finished = link(new, rounds[1], first.handed_on, 1)
    assert len(finished) == len(first.handed_on) and second.handed_on
    for h, c in zip(first.handed_on, finished):
        prompt = rounds[0][h["group"]][0]
        if partial == "continue":  # its tokens so far kept, the rest from the newer weights
            k = len(h["ids"])
            assert c.ids[:k] == h["ids"] and c.logps[:k] == h["logps"] and c.spans == [[0, k], [1, len(c.ids) - k]]
            want_old, _ = whole_logps(old, prompt, c.ids[:k], sampling.temperature)
            assert torch.allclose(torch.tensor(c.logps[:k]), want_old, atol=1e-5)
            want, _ = whole_logps(new, prompt, c.ids, sampling.temperature)
            assert torch.allclose(torch.tensor(c.logps[k:]), want[k:], atol=1e-5)
        else:  # sampled again from its start, all on the newer weights
            assert c.restarted and c.spans == [[1, len(c.ids)]]
            want, _ = whole_logps(new, prompt, c.ids, sampling.temperature)
            assert torch.allclose(torch.tensor(c.logps), want, atol=1e-5)
    again = link(new, rounds[1], first.handed_on, 1)
    assert again[2] == finished and again[1] == done1 and again[0].handed_on == second.handed_on


def test_a_continuous_batch_refuses_a_cache_it_cannot_pad():
    import transformers as tf

    torch.manual_seed(0)
    config = hf_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="rollout.slots: a continuous batch needs full-attention cache layers; "
                                         "this model's are DynamicSlidingWindowLayer: set rollout.slots=0"):
        TransformersEngine(model, (EOS,)).groups([(PROMPT, [1, 2])], Sampling(max_completion_length=4), 2)


@pytest.mark.parametrize("keys,words", [
    (["rollout.engine=replay", "rollout.replay=r.jsonl", "rollout.slots=4"], "rollout.slots: rollout.engine=replay "
     "samples nothing"),
    (["model.kind=gpt", "rollout.slots=4"], "rollout.slots: a continuous batch needs a transformers causal LM's KV "
     "cache; model.kind=gpt samples a group at a time"),
    (["rollout.engine=replay", "rollout.replay=r.jsonl", "rollout.dynamic_sampling=true"],
     "rollout.dynamic_sampling: a replayed round's prompts are the file's"),
    (["rollout.is_clip_min=4"], "rollout.is_clip_min: 4 is above rollout.is_clip_max (3)"),
    (["rollout.replay=r.jsonl"], "rollout.replay: read only by rollout.engine=replay"),
    (["rollout.partial=continue", "rollout.max_lag=1"], "rollout.partial: continue hands a continuous batch's "
     "unfinished completions on to the next round's; set rollout.slots"),
    (["rollout.partial=restart", "rollout.slots=4"], "rollout.partial: restart needs rollout.max_lag >= 1"),
    (["rollout.engine=vllm"], "vllm: no engine of rayzero's samples through vllm yet"),
])
def test_the_rollout_settings_that_cannot_work_together_are_refused_in_one_line(keys, words):
    from rayzero.config import ConfigError, load_config

    model = ["model.kind=hf", "model.path=/nowhere"] if "model.kind=gpt" not in keys else []
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(None, [*model, "train.objective=grpo", "grpo.max_completion_length=8", *keys])


def test_a_resume_that_cannot_continue_the_rounds_in_flight_is_refused_in_one_line():
    """The rows a round handed on belong to one rollout actor's next call: a checkpoint with such
    rounds in flight resumes with its `rollout.partial` and `rollout.workers`, or says which to set."""
    from rayzero.cluster.rollouts import Rollouts
    from rayzero.config import load_config

    def rollouts(*keys):
        cfg = load_config(None, ["model.kind=hf", "model.path=/nowhere", "train.objective=grpo",
                                 "grpo.max_completion_length=8", "rollout.max_lag=1", "rollout.slots=4", *keys])
        return Rollouts(cfg, [], [], None, None, set())

    chained = {"version": 1, "jobs": [{"prompt": 0}, {"prompt": 1}], "parts": {"0": [0], "1": [1]},
               "results": {"0": {"groups": [None], "handed_on": []}, "1": {"groups": [None], "handed_on": []}},
               "handed": {}}
    state = {"rounds": {"3": chained}, "extra_prompts": 0, "partial": "continue", "workers": 2}
    same = rollouts("rollout.partial=continue", "rollout.workers=2")
    same.restore(state)
    assert same.flights[3].chained and same.flights[3].parts == {0: [0], 1: [1]}
    with pytest.raises(ValueError, match=re.escape("resume with rollout.workers=2 (this run has 1)")):
        rollouts("rollout.partial=continue", "rollout.workers=1").restore(state)
    with pytest.raises(ValueError, match=re.escape("rollout.partial=continue; resume with it (this run has finish)")):
        rollouts("rollout.workers=2").restore(state)
    finished = {"rounds": {"3": {"version": 1, "jobs": [], "groups": []}}, "partial": "finish", "workers": 2}
    rollouts("rollout.workers=1").restore(finished)  # whole rounds: any number of actors goes on from them
