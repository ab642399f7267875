"""An instruction fine-tune through `rayzero train` (the CLI's `main`, on the session's cluster)
trains the model TRL's `SFTTrainer` trains (trl, a dev dependency, run by
`tests/trl_reference.py`): a Qwen2 chat model with ChatML's template, single-turn conversations,
the loss on the assistant's turn only, the same hyperparameters. rayzero runs at 2 ranks under
ZeRO-3 with the conversations packed into windows, each attending to itself alone; TRL runs in
one process with each conversation padded on its own (its default). Three optimizer steps, each
on every conversation: each step's loss and gradient norm equal TRL's, and the weights' update
within 1e-4 of TRL's (relative, tensor by tensor); for a full fine-tune and for LoRA (from
PEFT's initial adapters, as TRL seeded them)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rayzero.cluster.history import load_rows
from tests.models import save_chat_model

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

WORDS = ["json", "dict", "list", "loads", "dumps", "parse", "float", "string"]
CONVERSATIONS = [([{"role": "user", "content": f"what does {w} mean?"}],
                  [{"role": "assistant", "content": f"{w} is a {WORDS[(i + 3) % len(WORDS)]} of the module"}])
                 for i, w in enumerate(WORDS[:6])]
LORA = dict(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
CASES = {"full": dict(lr=1e-3), "lora": dict(lr=1e-2, lora=LORA)}
STEPS = 3


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("sft") / "qwen2", [Path(sys.modules["json"].__file__).read_text()])


@pytest.mark.parametrize("case", list(CASES))
def test_an_instruction_fine_tune_updates_the_weights_as_trls_sft_trainer(case, chat_dir, train_here, tmp_path):
    from rayzero.data.tokens import prepare
    from tests.trl_reference import trl_sft

    kw = dict(CASES[case])
    lora = kw.pop("lora", None)
    init = tmp_path / "adapter-init"
    theirs = trl_sft(chat_dir, [{"prompt": p, "completion": c} for p, c in CONVERSATIONS], steps=STEPS, lr=kw["lr"],
                     weight_decay=0.1, max_grad_norm=1.0, lora=lora, lora_init_dir=str(init) if lora else None)

    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": p + c}) + "\n" for p, c in CONVERSATIONS))
    prepare(tmp_path / "chat.jsonl", str(tmp_path / "data"), tokenizer=str(chat_dir), instructions=True)
    keys = ["model.kind=hf", f"model.path={chat_dir}", f"data.path={tmp_path / 'data'}", "cluster.num_workers=2",
            "sharding.strategy=optim_grads_params", "train.seq_len=127", "train.global_batch_size=4",
            "train.micro_batch_size=1", f"train.steps={STEPS}", f"optim.lr={kw['lr']}", "optim.schedule=constant",
            "optim.warmup_steps=0", "optim.beta1=0.9", "optim.beta2=0.999", "optim.eps=1e-8",
            "optim.weight_decay=0.1", "optim.grad_clip=1.0", "checkpoint.dir=", "tracking.enabled=false"]
    if lora:  # PEFT's initial adapters (as TRL seeded them) are where ours start
        keys += [f"model.adapter={init}"]
    out = tmp_path / "ours.safetensors"
    code, _, err, s = train_here(*keys, f"train.save_final={out}")
    assert code == 0, err[-3000:]
    from rayzero.data.instruct import Epochs
    from rayzero.data.tokens import TokenDataset

    windows = Epochs(TokenDataset(str(tmp_path / "data")).document_lengths, 0, 4, 128).windows(0)
    assert len(windows) < len(CONVERSATIONS) <= 4 * len(windows), "the conversations are packed, all in each step"
    rows = load_rows(Path(s["run_dir"]) / "history.jsonl")
    assert len(rows) == STEPS == len(theirs["metrics"])
    for k, (ours, trl) in enumerate(zip(rows, theirs["metrics"])):
        assert ours["loss"] == pytest.approx(trl["loss"], rel=1e-5), f"{case} step {k + 1} loss"
        assert ours["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-4), f"{case} step {k + 1} grad norm"
    ours = load_file(out)  # with LoRA: the adapters merged into the base, as TRL's merged state dict
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(chat_dir), dtype=torch.float32).state_dict()
    moved = 0
    for name, trl in theirs["state_dict"].items():
        update, want = ours[name] - initial[name], trl - initial[name]
        if want.norm() > 0:
            moved += 1
            assert float((update - want).norm() / want.norm()) <= 1e-4, name
        else:
            assert torch.equal(ours[name], initial[name]), name
    # LoRA: q_proj and v_proj of the 2 layers (the adapters merged in); full: every tensor
    assert moved == (4 if lora else len(theirs["state_dict"])), "the steps moved the weights the fine-tune trains"
