"""`train.objective=dpo` through `rayzero train` (the CLI's `main`, on the session's cluster)
equals TRL's `DPOTrainer` (trl, a dev dependency, run by `tests/trl_reference.py`): the same
tiny Llama, tokenizer, pairs and hyperparameters, three optimizer steps: each step's loss, gradient norm
and every reward metric equal (so each step began on the same weights), and the weights after
the third within 1e-5 (relative, tensor by tensor). For the sigmoid loss, and LoRA (TRL's reference: the base with the
adapters off; ours too). The other losses differ from sigmoid in the loss function alone: each of ours equals its formula
(tests/unit/test_dpo_losses.py), and TRL's IPO, hinge and robust equal the hand-written loop there
(tests/unit/test_trl_reference.py). The pairs are prepared by `rayzero data prepare --preferences`, tokenized as TRL
tokenizes them; one pair's rejected completion is cut by the sequence length as TRL cuts it."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rayzero.cluster.history import load_rows
from tests.unit.test_trl_reference import MAX_LENGTH, RECORDS, assert_weights, initial_weights, model_dir  # noqa: F401

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

PAIRS = [RECORDS[0], RECORDS[1], RECORDS[3]]  # every step trains on these three (one cut to MAX_LENGTH)
LORA = dict(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
CASES = {"sigmoid": dict(loss="sigmoid", lr=1e-3), "lora": dict(loss="sigmoid", lr=1e-2, lora=LORA)}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_equals_trls_dpo_trainer_step_by_step(case, model_dir, train_here, tmp_path):  # noqa: F811
    from rayzero.data.tokens import prepare
    from tests.trl_reference import trl_dpo

    kw = dict(CASES[case])
    lora = kw.pop("lora", None)
    common = dict(pairs_per_step=len(PAIRS), beta=0.1, max_length=MAX_LENGTH, weight_decay=0.1, max_grad_norm=0.5,
                  **kw)
    init = tmp_path / "adapter-init"
    steps = 3
    theirs = trl_dpo(model_dir, model_dir, PAIRS, steps=steps, lora=lora, lora_init_dir=str(init) if lora else None,
                     **common)

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    meta = prepare(tmp_path / "pairs.jsonl", str(tmp_path / "data"), tokenizer=str(model_dir), preferences=True)
    assert meta["num_pairs"] == len(PAIRS)
    keys = ["model.kind=hf", f"model.path={model_dir}", f"data.path={tmp_path / 'data'}", "train.objective=dpo",
            f"dpo.loss={kw['loss']}", "dpo.beta=0.1", f"train.seq_len={MAX_LENGTH - 1}",
            f"train.global_batch_size={2 * len(PAIRS)}", "train.micro_batch_size=2", "cluster.num_workers=1",
            f"optim.lr={kw['lr']}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.beta1=0.9",
            "optim.beta2=0.999", "optim.eps=1e-8", "optim.weight_decay=0.1", "optim.grad_clip=0.5",
            "checkpoint.dir=", "tracking.enabled=false"]
    if lora:  # PEFT's initial adapters (as TRL seeded them) are where ours start
        keys += [f"model.adapter={init}"]
    out = tmp_path / "ours.safetensors"
    code, _, err, s = train_here(*keys, f"train.steps={steps}", f"train.save_final={out}")
    assert code == 0, err[-3000:]
    rows = load_rows(Path(s["run_dir"]) / "history.jsonl")
    assert len(rows) == steps == len(theirs["metrics"])
    for k, (ours, trl) in enumerate(zip(rows, theirs["metrics"])):
        for name in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                     "rewards/margins", "logps/chosen", "logps/rejected"):
            assert ours[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-6), f"{case} step {k + 1} {name}"
    weights = load_file(out)  # with LoRA: the adapters merged into the base, as TRL's `state_dict`
    assert_weights({k: weights[k] for k in theirs["state_dict"]}, theirs["state_dict"], initial_weights(model_dir))
