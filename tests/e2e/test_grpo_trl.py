"""`train.objective=grpo` through `rayzero train` (the CLI's `main`, on the session's cluster)
updates the weights as TRL's `GRPOTrainer` does on the same completions: TRL's own hook for
supplied completions (`rollout_func`) draws them and writes them down as rayzero's replay engine
reads them (`rollout.engine=replay`), both score them with the same two reward functions
(weighted), and after 3 optimizer steps the weights of 2 ranks under ZeRO-3 are TRL's (one
process) within 1e-5, and each step's loss, KL, clip ratios, entropy and rewards are what TRL
logged. The cases meet every loss_type, beta 0 and > 0, num_iterations 1 and 2, full and LoRA,
the clip and its clip-higher, a sampling temperature and masked truncated completions."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from rayzero.cluster.history import load_rows
from tests.unit.test_trl_reference import initial_weights, model_dir  # noqa: F401

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

PROMPTS = [{"prompt": "Q: what is two plus two? A:"}, {"prompt": "The sky is"}, {"prompt": "The grass is"},
           {"prompt": "Q: what is"}]
REWARDS = Path(__file__).resolve().parents[1] / "grpo_rewards.py"
LORA = dict(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
CASES = {
    "dapo": dict(loss_type="dapo", lr=5e-3),
    "grpo-kl-mu2": dict(loss_type="grpo", beta=0.1, num_iterations=2, epsilon=0.1, epsilon_high=0.2, lr=2e-2,
                        temperature=0.7),
    "bnpo-kl-lora": dict(loss_type="bnpo", beta=0.2, lora=LORA, lr=5e-2, mask_truncated_completions=True),
    "dr_grpo-mu2-lora": dict(loss_type="dr_grpo", num_iterations=2, lora=LORA, lr=5e-2, scale_rewards="batch"),
}
G, PER_STEP, STEPS, MAX_COMPLETION = 4, 2, 3, 6


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_equals_trls_grpo_trainer_on_the_same_completions(case, model_dir, train_here, tmp_path):  # noqa: F811
    from rayzero.data.tokens import prepare
    from tests.grpo_rewards import text_length, token_sum
    from tests.trl_reference import trl_grpo

    kw = dict(CASES[case])
    lora = kw.pop("lora", None)
    lr = kw.pop("lr")
    replay = tmp_path / "replay.jsonl"
    init = tmp_path / "adapter-init"
    theirs = trl_grpo(model_dir, PROMPTS, [token_sum, text_length], steps=STEPS, prompts_per_step=PER_STEP,
                      num_generations=G, max_completion_length=MAX_COMPLETION, replay_path=replay, lr=lr,
                      reward_weights=[1.0, 0.5], lora=lora, lora_init_dir=str(init) if lora else None, **kw)

    (tmp_path / "prompts.jsonl").write_text("".join(__import__("json").dumps(p) + "\n" for p in PROMPTS))
    prepare(tmp_path / "prompts.jsonl", str(tmp_path / "data"), tokenizer=str(model_dir), prompts=True)
    keys = ["model.kind=hf", f"model.path={model_dir}", f"data.path={tmp_path / 'data'}", "train.objective=grpo",
            f"grpo.reward_funcs={REWARDS}:token_sum,{REWARDS}:text_length", "grpo.reward_weights=1.0,0.5",
            f"grpo.num_generations={G}", f"grpo.max_completion_length={MAX_COMPLETION}", "grpo.disable_dropout=true",
            *(f"grpo.{k}={v}" for k, v in kw.items()),
            "rollout.engine=replay", f"rollout.replay={replay}", "rollout.cpus_per_worker=0.5",
            "train.seq_len=24", f"train.global_batch_size={G * PER_STEP}", "train.micro_batch_size=2",
            "cluster.num_workers=2", "cluster.cpus_per_worker=0.5", "sharding.strategy=optim_grads_params",
            f"optim.lr={lr}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.beta1=0.9",
            "optim.beta2=0.999", "optim.eps=1e-8", "optim.weight_decay=0", "optim.grad_clip=1.0",
            "checkpoint.dir=", "tracking.enabled=false"]
    if lora:
        keys += [f"model.adapter={init}"]
    out = tmp_path / "ours.safetensors"
    code, _, err, s = train_here(*keys, f"train.steps={STEPS}", f"train.save_final={out}")
    assert code == 0, err[-3000:]
    rows = load_rows(Path(s["run_dir"]) / "history.jsonl")
    assert len(rows) == STEPS == len(theirs["metrics"])
    for k, (ours, trl) in enumerate(zip(rows, theirs["metrics"])):
        for name, value in trl.items():
            if value is None or name not in ours and k % kw.get("num_iterations", 1):
                continue  # TRL logs a round's rewards and lengths at its first step; so does rayzero
            assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{case} step {k + 1} {name}"
    assert_close_to_trl(load_file(out), theirs["state_dict"], initial_weights(model_dir))


def assert_close_to_trl(ours: dict, trl: dict, initial: dict) -> None:
    """The issue's target, tensor by tensor: the weights within 1e-3 of TRL's (relative to their
    norm; measured: 1e-5 and below), and the 3 steps' change cosine >= 0.999 to TRL's change and
    within 1e-3 of it (relative to its size)."""
    import torch

    moved_any = False
    for k, theirs in trl.items():
        assert float((ours[k] - theirs).norm() / theirs.norm()) <= 1e-3, k
        a, b = (ours[k] - initial[k]).flatten(), (theirs - initial[k]).flatten()
        if float(b.norm()) == 0.0:
            assert float(a.norm()) == 0.0, f"{k} moved here, not in TRL"
            continue
        moved_any = True
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) >= 0.999, k
        assert float((a - b).norm() / b.norm()) <= 1e-3, f"{k}: the change differs by {float((a - b).norm() / b.norm()):.2e}"
    assert moved_any, "nothing trained"
