"""The TRL reference itself (`tests/trl_reference.py`) checked against a DPO loop written here
by hand in plain torch: the model loaded from the same directory, the reference a frozen copy
(with LoRA: the base with the adapters off), each sequence run alone and its log-probability
summed over its completion tokens, `torch.optim.AdamW` on the same settings. The weights after
1 and 3 steps and every logged metric must agree, so that a rayzero run set beside
`trl_dpo` is compared with TRL's DPO as it is, not with an accident of the harness. Each TRL
run takes a few seconds: one case is in the fast tier, the rest are `slow`."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.models import save_hf_model, save_tokenizer
from tests.trl_reference import DPO_METRICS, lora_config, trl_dpo

pytest.importorskip("trl")

TEXTS = ["Q: what is two plus two? A: four", "The sky is blue and the grass is green.",
         "hello world, hello there", "one two three four five six seven eight nine ten"]
RECORDS = [
    dict(prompt="Q: what is two plus two? A:", chosen=" four", rejected=" five"),
    dict(prompt="The sky is", chosen=" blue", rejected=" green and the grass is blue"),
    dict(prompt="hello", chosen=" world", rejected=" there, hello"),
    # prompt + rejected is longer than MAX_LENGTH: TRL keeps its start
    dict(prompt="one two", chosen=" three four", rejected=" nine ten eight seven six five four three two one"),
    dict(prompt="The grass is", chosen=" green.", rejected=" blue."),
    dict(prompt="Q: what is", chosen=" two plus two?", rejected=" the sky?"),
]
MAX_LENGTH = 12
EOS = "</s>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (hidden 32, 2 layers, 4 heads, tied embeddings) and, in the same directory,
    a BPE tokenizer trained on TEXTS whose vocabulary is the model's; </s> ends sequences
    and pads (TRL pads with EOS when the tokenizer has no pad token)."""
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("dpo") / "llama"
    path.mkdir()
    save_tokenizer(path, TEXTS, vocab=300)
    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": EOS}))
    return save_hf_model("llama", path, vocab_size=vocab, bos_token_id=0, eos_token_id=1)


# -- the hand-written loop -------------------------------------------------------------------------
def tokenize(model_dir, record, max_length):
    """(ids, first completion position) of prompt + chosen + EOS and of prompt + rejected +
    EOS, cut to max_length keeping the start: by `tokenizers` directly, not TRL."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tok.encode(record["prompt"]).ids
    out = []
    for key in ("chosen", "rejected"):
        ids = tok.encode(record["prompt"] + record[key] + EOS).ids
        assert ids[: len(prompt)] == prompt, "the test's prompts end on a token boundary"
        out.append((ids[:max_length], len(prompt)))
    return out


def seq_logp(model, ids, start):
    """The sum of log p(ids[t] | ids[:t]) over the completion positions t >= start."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = logits[:-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp[start - 1:].sum()


def pair_loss(loss, beta, ls, margin, n_chosen, n_rejected, delta_avg):
    if loss == "sigmoid":
        return -F.logsigmoid(beta * margin)
    if loss == "hinge":
        return torch.relu(1 - beta * margin)
    if loss == "robust":
        return (-(1 - ls) * F.logsigmoid(beta * margin) + ls * F.logsigmoid(-beta * margin)) / (1 - 2 * ls)
    if loss == "ipo":  # the margin of the per-token averages, each over its own completion's tokens
        return (delta_avg - 1 / (2 * beta)) ** 2
    raise ValueError(loss)


def hand_dpo(model_dir, records, *, steps, pairs_per_step, lr, beta=0.1, loss="sigmoid", label_smoothing=0.0,
             max_length, weight_decay=0.0, max_grad_norm=1.0, betas=(0.9, 0.999), eps=1e-8, lora=None,
             adapter_init=None):
    """Plain-torch DPO: (per-step metrics, weights after each step). Weight decay on the
    matrices (dim >= 2), rayzero's rule."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if lora is not None:
        from peft import get_peft_model, set_peft_model_state_dict

        model = get_peft_model(model, lora_config(lora))
        set_peft_model_state_dict(model, adapter_init)
        reference = None  # the base: the adapters off
    else:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
                             {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps)
    data = [tokenize(model_dir, r, max_length) for r in records]
    metrics, weights = [], []
    for step in range(steps):
        lo = step * pairs_per_step % len(data)
        batch = data[lo: lo + pairs_per_step]
        stats = {k: [] for k in ("loss", *DPO_METRICS)}
        for (c_ids, c_start), (r_ids, r_start) in batch:
            pc, pr = seq_logp(model, c_ids, c_start), seq_logp(model, r_ids, r_start)
            with torch.no_grad():
                if reference is None:
                    with model.disable_adapter():
                        rc, rr = seq_logp(model, c_ids, c_start), seq_logp(model, r_ids, r_start)
                else:
                    rc, rr = seq_logp(reference, c_ids, c_start), seq_logp(reference, r_ids, r_start)
            margin = (pc - rc) - (pr - rr)
            nc, nr = len(c_ids) - c_start, len(r_ids) - r_start
            delta_avg = (pc - rc) / nc - (pr - rr) / nr
            pl = pair_loss(loss, beta, label_smoothing, margin, nc, nr, delta_avg)
            (pl / len(batch)).backward()
            chosen_reward, rejected_reward = beta * (pc - rc).detach(), beta * (pr - rr).detach()
            for k, v in (("loss", pl), ("rewards/chosen", chosen_reward), ("rewards/rejected", rejected_reward),
                         ("rewards/accuracies", (chosen_reward > rejected_reward).float()),
                         ("rewards/margins", chosen_reward - rejected_reward), ("logps/chosen", pc),
                         ("logps/rejected", pr)):
                stats[k].append(float(v.detach()))
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in params],
                                              max_grad_norm if max_grad_norm > 0 else float("inf"))
        opt.step()
        opt.zero_grad()
        metrics.append({**{k: sum(v) / len(v) for k, v in stats.items()}, "grad_norm": float(norm)})
        weights.append(current_weights(model, lora is not None))
    return metrics, weights


def current_weights(model, peft):
    if not peft:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    from peft import get_peft_model_state_dict

    merged = copy.deepcopy(model).merge_and_unload()
    return {"adapter": {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()},
            "merged": {k: v.detach().clone() for k, v in merged.state_dict().items()}}


# -- comparisons -----------------------------------------------------------------------------------
def assert_weights(ours, trl, initial):
    """Each tensor within 1e-5 of TRL's, relative to its norm; and the change the steps made
    within 1e-3 of TRL's change, which is well past the tolerance. Not element by element: an
    element whose gradient is near AdamW's eps (1e-8) moves by lr x g / (|g| + eps), which an
    fp32 rounding of g shifts by a percent."""
    assert ours.keys() == trl.keys()
    for k in trl:
        diff = float((ours[k] - trl[k]).norm() / trl[k].norm())
        assert diff < 1e-5, f"{k}: relative difference {diff:.2e}"
        moved = float((trl[k] - initial[k]).norm())
        if moved > 0:
            assert moved > 1e-4 * float(initial[k].norm()), f"{k}: hardly moved"
            update_diff = float(((ours[k] - initial[k]) - (trl[k] - initial[k])).norm()) / moved
            assert update_diff < 1e-3, f"{k}: update differs by {update_diff:.2e} of itself"


def assert_metrics(ours, trl):
    assert len(ours) == len(trl)
    for step, (a, b) in enumerate(zip(ours, trl), 1):
        for k in ("loss", "grad_norm", *DPO_METRICS):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), f"step {step} {k}: {a[k]} vs TRL {b[k]}"


def initial_weights(model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# -- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    # the same 2 pairs every step; no decay; the clip above the gradient's norm
    dict(records=RECORDS[:2], pairs_per_step=2, weight_decay=0.0, max_grad_norm=1.0),
    # 3 pairs a step, new ones each step (one cut by max_length); decay; the clip active
    pytest.param(dict(records=RECORDS, pairs_per_step=3, weight_decay=0.1, max_grad_norm=0.3),
                 marks=pytest.mark.slow),
], ids=["same-pairs", "new-pairs-decay-clip"])
def test_trl_dpo_is_plain_dpo_after_1_and_3_steps(model_dir, case):
    kw = dict(lr=1e-3, beta=0.1, max_length=MAX_LENGTH, **case)
    records = kw.pop("records")
    theirs1 = trl_dpo(model_dir, model_dir, records, steps=1, **kw)
    theirs3 = trl_dpo(model_dir, model_dir, records, steps=3, **kw)
    ours, weights = hand_dpo(model_dir, records, steps=3, **kw)

    assert theirs1["metrics"] == theirs3["metrics"][:1]
    # the first step's policy is the reference: every margin is 0, the loss ln 2, no pair counted right
    first = theirs3["metrics"][0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["rewards/margins"] == first["rewards/accuracies"] == 0.0
    assert all(m["learning_rate"] == 1e-3 for m in theirs3["metrics"])
    if kw["max_grad_norm"] < 1.0:
        assert all(m["grad_norm"] > kw["max_grad_norm"] for m in theirs3["metrics"])  # so it clipped
    assert_metrics(ours, theirs3["metrics"])
    init = initial_weights(model_dir)
    assert_weights(weights[0], theirs1["state_dict"], init)
    assert_weights(weights[2], theirs3["state_dict"], init)
    # TRL's tokenization is the plain one here: prompt, then the completion and EOS, cut to max_length
    for r, t, seq in zip(records, theirs3["tokenized"], theirs3["sequences"]):
        (c, start), _ = tokenize(model_dir, r, 10**9)
        assert t["prompt_ids"] + t["chosen_ids"] == c and len(t["prompt_ids"]) == start and t["chosen_ids"][-1] == 1
        (c, start), (rj, _) = tokenize(model_dir, r, MAX_LENGTH)
        assert (seq["chosen"], seq["rejected"], seq["prompt_len"]) == (c, rj, start)
    if len(records) > 3:  # RECORDS[3]'s rejected was cut
        assert len(theirs3["tokenized"][3]["prompt_ids"] + theirs3["tokenized"][3]["rejected_ids"]) > MAX_LENGTH


@pytest.mark.slow
@pytest.mark.parametrize("loss,ls", [("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)])
def test_the_other_losses(model_dir, loss, ls):
    kw = dict(pairs_per_step=3, lr=1e-3, beta=0.1, loss=loss, label_smoothing=ls, max_length=MAX_LENGTH)
    theirs = trl_dpo(model_dir, model_dir, RECORDS, steps=2, **kw)
    ours, weights = hand_dpo(model_dir, RECORDS, steps=2, **kw)
    assert_metrics(ours, theirs["metrics"])
    assert_weights(weights[-1], theirs["state_dict"], initial_weights(model_dir))


@pytest.mark.slow
def test_sigmoid_takes_no_label_smoothing(model_dir):
    """TRL 1.16 smooths only `robust`, `exo_pair` and `aot`: `sigmoid` with label_smoothing is
    plain DPO, not cDPO."""
    kw = dict(steps=2, pairs_per_step=3, lr=1e-3, max_length=MAX_LENGTH)
    plain = trl_dpo(model_dir, model_dir, RECORDS, **kw)
    smoothed = trl_dpo(model_dir, model_dir, RECORDS, label_smoothing=0.2, **kw)
    assert smoothed["metrics"] == plain["metrics"]


@pytest.mark.slow
def test_precomputed_reference_is_the_same_run(model_dir):
    kw = dict(steps=3, pairs_per_step=3, lr=1e-3, max_length=MAX_LENGTH)
    theirs = trl_dpo(model_dir, model_dir, RECORDS, precompute=True, **kw)
    ours, weights = hand_dpo(model_dir, RECORDS, **kw)
    assert_metrics(ours, theirs["metrics"])
    assert_weights(weights[-1], theirs["state_dict"], initial_weights(model_dir))


@pytest.mark.slow
@pytest.mark.parametrize("precompute", [False, True], ids=["ref-adapters-off", "precomputed"])
def test_lora(model_dir, tmp_path, precompute):
    """LoRA through TRL's `peft_config`: the reference is the base (adapters off); the adapters
    start as PEFT initialized them under TRL's seed, saved to `lora_init_dir` for the other
    side to start from."""
    lora = dict(r=4, alpha=8, dropout=0.0, target_modules="q_proj,v_proj".split(","))
    kw = dict(steps=3, pairs_per_step=3, lr=1e-2, max_length=MAX_LENGTH, weight_decay=0.1)
    theirs = trl_dpo(model_dir, model_dir, RECORDS, lora=lora, precompute=precompute,
                     lora_init_dir=str(tmp_path / "init"), **kw)
    assert json.loads((tmp_path / "init" / "adapter_config.json").read_text())["r"] == 4
    assert theirs["metrics"][0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    ours, weights = hand_dpo(model_dir, RECORDS, lora=lora, adapter_init=theirs["adapter_init"], **kw)
    assert_metrics(ours, theirs["metrics"])
    assert sorted(theirs["adapter"]) == sorted(theirs["adapter_init"])
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in theirs["adapter"])
    assert_weights(weights[-1]["adapter"], theirs["adapter"], theirs["adapter_init"])
    assert_weights(weights[-1]["merged"], theirs["state_dict"], initial_weights(model_dir))


@pytest.mark.slow  # ~10 s: in the full suite, not the fast tier
def test_hf_trainer_decays_what_rayzero_decays_on_llama(model_dir):
    """The Trainer's weight decay skips biases and norms by name; on Llama that is exactly the
    1-D parameters, rayzero's `dim() >= 2` rule."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(model_dir / "out"), use_cpu=True,
                                                          report_to=[]))
    decays = set(trainer.get_decay_parameter_names(model))  # names the tied head too; the optimizer's groups:
    assert {n for n, _ in model.named_parameters() if n in decays} == {
        n for n, p in model.named_parameters() if p.dim() >= 2}
