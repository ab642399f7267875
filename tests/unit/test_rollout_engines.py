"""The rollout engines (`rayzero/rollout/engines.py`) on a tiny Llama: greedy sampling is
transformers' own `generate`; each token's log-probability is the tempered distribution's, as a
whole forward of the prompt and completion gives it; top-k keeps to the k likeliest; a
completion's draws are a function of its seed alone (the same group sampled again, by another
engine, is the same; another round is not); it stops at an end id or at max_completion_length,
and says which. The replay engine reads recorded rounds in the file's order and refuses what
does not match, in one line."""

from __future__ import annotations

import json

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
