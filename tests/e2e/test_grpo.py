"""Online RL through `rayzero train` (the CLI's `main`, on the session's cluster), with the
transformers engine sampling on a rollout actor of its own, one round ahead of the ranks
(`rollout.max_lag=1`, truncated importance sampling, a continuous batch whose unfinished
completions are finished on their weights or handed on to the next round's batch): a 2-rank
GRPO run reports TRL's metrics, the weight syncs, each round's weight version and the sampler's
mismatch; stopped at a commit (the round in flight kept in it, and what it handed on) and rerun
by its command it ends bitwise equal to the unbroken run; a rollout actor killed while it generates is replaced, its prompts sampled again from the
same weights with the same draws, and the run ends bitwise equal too. A reward that raises ends
the run after its last commit. Bad input is refused in one line before the cluster starts."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rayzero.cluster.history import load_rows
from tests.unit.test_trl_reference import model_dir  # noqa: F401

pytestmark = pytest.mark.slow
REWARDS = Path(__file__).resolve().parents[1] / "grpo_rewards.py"
PROMPTS = [{"prompt": p} for p in ("Q: what is two plus two? A:", "The sky is", "The grass is", "Q: what is",
                                   "The sky", "A: four")]


@pytest.fixture
def run_keys(model_dir, tmp_path):  # noqa: F811
    from rayzero.data.tokens import prepare

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    prepare(tmp_path / "prompts.jsonl", str(tmp_path / "data"), tokenizer=str(model_dir), prompts=True)
    return ["model.kind=hf", f"model.path={model_dir}", f"data.path={tmp_path / 'data'}", "train.objective=grpo",
            f"grpo.reward_funcs={REWARDS}:token_sum,{REWARDS}:text_length", "grpo.num_generations=4",
            "grpo.max_completion_length=12", "grpo.temperature=0.9", "grpo.beta=0.05", "optim.lr=1e-2", "optim.schedule=constant", "optim.warmup_steps=0",
            "rollout.cpus_per_worker=0.5", "train.seq_len=32", "train.global_batch_size=8",
            "train.micro_batch_size=2", "cluster.num_workers=2", "cluster.cpus_per_worker=0.5",
            "sharding.strategy=optim_grads_params", "checkpoint.every_steps=2", "tracking.enabled=false"]


def final(s: dict) -> dict:
    return load_file(s["final_weights"])


@pytest.mark.parametrize("partial", ["finish", "continue"])
def test_grpo_reports_resumes_bitwise_and_survives_a_lost_rollout_actor(partial, run_keys, train_here, tmp_path):
    # generation one round ahead of training (each round from the weights of the round before),
    # corrected by the truncated importance ratio of the trainer to the sampler; a round's 8
    # completions sampled through a continuous batch of 4 rows, whose last ones are finished on
    # their weights, or handed on to the next round's batch and continued on its weights
    run_keys = [*run_keys, "rollout.max_lag=1", "rollout.is_correction=token_truncate", "rollout.slots=4",
                f"rollout.partial={partial}"]
    # the unbroken run
    code, _, err, s = train_here(*run_keys, f"checkpoint.dir={tmp_path / 'a'}", "train.steps=4",
                                 f"train.save_final={tmp_path / 'a.safetensors'}", summary="a.json")
    assert code == 0, err[-3000:]
    rows = load_rows(Path(s["run_dir"]) / "history.jsonl")
    for name in ("reward", "reward_std", "rewards/token_sum/mean", "rewards/text_length/std", "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio", "kl", "entropy", "clip_ratio/region_mean",
                 "generate_ms", "wait_ms", "score_ms", "sync_ms", "sync_bytes", "weight_version", "staleness",
                 "sampling/kl", "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean"):
        assert all(name in r for r in rows), name
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 2]  # each round from the weights one round back
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0  # the policy starts as its reference
    # the sampler is the trainer at step 0 (the same weights, another program: its rounding), then a step behind
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert all(r["sampling/sampling_logp_difference/max"] > 1e-3 for r in rows[1:])
    assert set(s["final_rl"]) >= {"kl", "entropy"}
    if partial != "finish":  # round 2's last completions continued on round 3's newer weights (rounds 0
        # and 1 share weight version 0, and their completions run to the length limit together)
        assert rows[2]["partial/handed_on"] > 0 and rows[2]["partial/newer_tokens"] > 0, rows[2]
        assert rows[0]["partial/newer_tokens"] == 0

    # stopped at its commit after step 2, rerun by the same command to step 4: bitwise
    keys = [*run_keys, f"checkpoint.dir={tmp_path / 'b'}", f"train.save_final={tmp_path / 'b.safetensors'}"]
    code, _, err, _ = train_here(*keys, "train.steps=2", summary="b1.json")
    assert code == 0, err[-3000:]
    actors = _kept_rollout_actors()
    code, _, err, b = train_here(*keys, "train.steps=4", "train.overwrite_final=true", summary="b2.json")
    assert code == 0, err[-3000:]
    assert "at step 2 of 4" in err
    _equal(final(s), final(b))
    # its rollout actor was the one the run before kept (`cluster.keep_ranks`), made anew
    assert actors and _kept_rollout_actors() == actors

    # a rollout actor killed while it generates: replaced, its prompts sampled again, bitwise
    killed = []

    def kill_one():
        deadline = time.time() + 120
        while not killed and time.time() < deadline:
            for d in Path("/proc").iterdir():
                try:
                    if d.name.isdigit() and (d / "cmdline").read_bytes().startswith(b"ray::RolloutWorker.generate"):
                        os.kill(int(d.name), signal.SIGKILL)
                        killed.append(int(d.name))
                        return
                except OSError:
                    pass
            time.sleep(0.001)

    watcher = threading.Thread(target=kill_one, daemon=True)
    watcher.start()
    code, _, err, c = train_here(*run_keys, f"checkpoint.dir={tmp_path / 'c'}", "train.steps=4",
                                 f"train.save_final={tmp_path / 'c.safetensors'}", summary="c.json")
    watcher.join(1)
    assert code == 0, err[-3000:]
    assert killed, "no rollout actor was seen generating"
    # lost while it generates a round, or while it takes the weights of the next (the process is
    # named after its generate call either way)
    assert "rollout actor 0 was lost generating round" in err or "rollout actor 0 was lost taking weight" in err
    assert c["restarts"] == 0  # the training ranks never noticed
    _equal(final(s), final(c))
    if partial == "finish":
        return
    # lost between rounds (killed as round 0 is scored): the next sync finds it gone, a new actor
    # takes that version and the ones its rounds in flight ask for, and the run ends bitwise too
    rewards = next(k for k in run_keys if k.startswith("grpo.reward_funcs="))
    keys = [k for k in run_keys if k != rewards] + [f"{rewards},{REWARDS}:lose_the_rollout_actor_once"]
    mark = tmp_path / "lost"
    os.environ["RAYZERO_TEST_LOSE_ACTOR"] = str(mark)
    try:
        code, _, err, d = train_here(*keys, f"checkpoint.dir={tmp_path / 'd'}", "train.steps=4",
                                     f"train.save_final={tmp_path / 'd.safetensors'}", summary="d.json")
    finally:
        del os.environ["RAYZERO_TEST_LOSE_ACTOR"]
    assert code == 0, err[-3000:]
    assert mark.exists() and "rollout actor 0 was lost taking weight version 1" in err
    assert d["restarts"] == 0
    _equal(final(s), final(d))


def _kept_rollout_actors() -> list[str]:
    from rayzero.cluster.worker_group import KEPT

    return [a._actor_id.hex() for a in KEPT.rollouts[2]] if KEPT.rollouts else []


def _equal(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("extra,words", [
    (["grpo.num_generations=3"], "train.global_batch_size: 8 completions is not a whole number of groups"),
    (["grpo.num_generations=1"], "grpo.num_generations: 1 leaves no group"),
    (["grpo.epsilon_high=0.1"], "grpo.epsilon_high: 0.1 is below grpo.epsilon"),
    (["grpo.reward_funcs=nowhere.py:f"], "reward nowhere.py:f: cannot import nowhere.py"),
    (["grpo.max_completion_length=30"], "prompts are longer than train.seq_len + 1 - grpo.max_completion_length"),
    (["rollout.engine=replay", "rollout.replay=missing.jsonl"], "missing.jsonl"),
])
def test_bad_grpo_input_is_refused_in_one_line(extra, words, run_keys, train_here):
    code, _, err, _ = train_here(*run_keys, "checkpoint.dir=", "train.steps=1", *extra)
    assert code == 2, err[-2000:]
    assert words in err, err[-2000:]


def test_the_dry_run_says_where_the_completions_come_from(run_keys, capsys, monkeypatch, tmp_path):
    from tests.conftest import cli_in_process

    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "train", "--dry-run", *run_keys, "checkpoint.dir=",
                                    "rollout.max_lag=1", "rollout.slots=4", "rollout.is_correction=token_truncate")
    assert code == 0, err
    assert ("rollouts: 1 actor (0.5 CPU each), each the whole policy in fp32 (" in out
            and "sampling with transformers (temperature 0.9, top_p 1, top_k 0; a continuous batch of 4 rows); "
                "2 prompts x 4 completions = 8 per round, up to 12 tokens each, a round every 1 step;" in out
            and "; generating 1 round ahead of training (each actor stages up to 1 more weight version); "
                "importance sampling token_truncate" in out), out


FAILING_REWARD = '''
from pathlib import Path


def grader(completions, **kwargs):
    """Scores the first round; then its grader is down (it raises) until a file says it is back."""
    here = Path(__file__).parent
    if (here / "called").exists() and not (here / "fixed").exists():
        raise ConnectionError("the grader is down")
    (here / "called").write_text("")
    return [float(len(c)) / 20 for c in completions]
'''


def test_a_reward_that_raises_ends_the_run_in_one_line_after_its_last_commit(run_keys, train_here, tmp_path):
    (tmp_path / "reward").mkdir()
    reward = tmp_path / "reward" / "flaky.py"
    reward.write_text(FAILING_REWARD)
    keys = [*(k for k in run_keys if not k.startswith(("grpo.reward_funcs=", "checkpoint.every_steps="))),
            f"grpo.reward_funcs={reward}:grader", "checkpoint.every_steps=1",
            f"checkpoint.dir={tmp_path / 'ckpt'}", "train.steps=3"]
    code, _, err, _ = train_here(*keys)
    assert code != 0
    line = next((x for x in err.splitlines() if "reward grader failed on prompt" in x), err[-1500:])
    assert "scoring the rollouts failed at step 1" in line and "ConnectionError: the grader is down" in line, line
    assert (tmp_path / "ckpt" / "step-000001").is_dir()  # step 1 was trained and is not lost
    (tmp_path / "reward" / "fixed").write_text("")  # the grader back: the same command resumes
    code, _, err, s = train_here(*keys, summary="again.json")
    assert code == 0, err[-3000:]
    assert "at step 1 of 3" in err
    assert [r["step"] for r in load_rows(Path(s["run_dir"]) / "history.jsonl")][-1] == 2


@pytest.mark.parametrize("ahead", [[], ["rollout.max_lag=2", "rollout.slots=4", "rollout.partial=continue",
                                        "rollout.max_extra_prompts=1"]], ids=["synchronous", "ahead"])
def test_dynamic_sampling_replaces_groups_without_an_advantage_and_resumes_bitwise(ahead, run_keys, train_here,
                                                                                    tmp_path):
    # synchronous; and two rounds ahead with partial rollouts, drawing at most one extra prompt a
    # round (sampled from the weights sent last, after the next round started on the actor), so
    # that a round can stay short and train on fewer micro-batches
    keys = [*(k for k in run_keys if not k.startswith("grpo.reward_funcs=")),
            f"grpo.reward_funcs={REWARDS}:flat_on_sky", "rollout.dynamic_sampling=true", *ahead]
    code, _, err, s = train_here(*keys, f"checkpoint.dir={tmp_path / 'a'}", "train.steps=6",
                                 f"train.save_final={tmp_path / 'a.safetensors'}", summary="a.json")
    assert code == 0, err[-3000:]
    rows = load_rows(Path(s["run_dir"]) / "history.jsonl")
    # 2 of the 6 prompts are about the sky: some round draws one, and it is replaced
    assert sum(r["dynamic_sampling/extra_prompts"] for r in rows) >= 1
    assert all(r["frac_reward_zero_std"] == 0.0 and r["dynamic_sampling/equal_kept"] == 0 for r in rows)
    groups = [r["dynamic_sampling/groups"] for r in rows]
    if not ahead:  # every sky prompt replaced by one that is not: each round full
        assert groups == [2] * 6
        assert sum(r["dynamic_sampling/equal_dropped"] for r in rows) == sum(r["dynamic_sampling/extra_prompts"]
                                                                             for r in rows)
    else:  # round 0 drew a sky prompt again: it trains on its one group, in 1 micro-batch a rank of 2
        assert groups[0] == 1 and rows[0]["dynamic_sampling/equal_dropped"] == 2 and max(groups) == 2, groups
        assert err.count("compiling the iteration") == 1  # the same compiled iteration for either
    # stopped at its commit after step 2 and rerun by the same command (steps 2-5: the second epoch,
    # whose sky prompts are replaced too): the extra prompts go on where they were (the checkpoint
    # keeps how many were drawn), and the run ends bitwise
    again = [*keys, f"checkpoint.dir={tmp_path / 'b'}", f"train.save_final={tmp_path / 'b.safetensors'}"]
    code, _, err, _ = train_here(*again, "train.steps=2", summary="b1.json")
    assert code == 0, err[-3000:]
    if ahead:  # rounds 2 and 3 in flight at the commit, each a link of actor 0's chain: another
        # number of actors cannot go on from them, and the rerun says so before it trains
        code, _, err, _ = train_here(*again, "train.steps=6", "rollout.workers=2", summary="b.json")
        line = next((x for x in err.splitlines() if "cannot resume from" in x), err[-1500:])
        assert code != 0 and "resume with rollout.workers=1 (this run has 2)" in line, line
    code, _, err, b = train_here(*again, "train.steps=6", "train.overwrite_final=true", summary="b2.json")
    assert code == 0, err[-3000:]
    assert "at step 2 of 6" in err
    assert sum(r["dynamic_sampling/extra_prompts"] for r in rows[2:]) >= 1
    _equal(final(s), final(b))
