"""The preference losses of `objectives/dpo.py` on hand-made log-probabilities: each equals its
formula (TRL's `DPOTrainer` / `ORPOTrainer` code where trl has it), a micro-batch's part of a
step's mean adds up over any split, and filler pairs take no part."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rayzero.objectives.config import DPOConfig
from rayzero.objectives.dpo import PreferenceLoss, as_floats, counts, pair_metrics
from rayzero.sharding.vocab_parallel import IGNORE_INDEX

T = 6


def batch(seed: int = 0, pairs: int = 4, empty: int = 0):
    """(per-token losses [2P, T], targets with 1..T completion tokens per row; `empty` filler
    pairs at the end, whose rows have none)."""
    g = torch.Generator().manual_seed(seed)
    losses = torch.rand(2 * pairs, T, generator=g) * 3
    targets = torch.full((2 * pairs, T), IGNORE_INDEX)
    for row in range(2 * (pairs - empty)):
        n = int(torch.randint(1, T + 1, (1,), generator=g))
        targets[row, T - n:] = 5
    losses = losses.masked_fill(targets == IGNORE_INDEX, 0.0)
    ref = -torch.rand(2 * pairs, generator=g) * 10
    return losses, targets, ref


def hand(cfg: DPOConfig, losses, targets, ref):
    """The per-pair losses and rewards, written out from the papers (and TRL)."""
    logp = -losses.sum(-1)
    n = (targets != IGNORE_INDEX).sum(-1).float()
    c, r, rc, rr, nc, nr = logp[0::2], logp[1::2], ref[0::2], ref[1::2], n[0::2], n[1::2]
    b, eps = cfg.beta, cfg.label_smoothing
    m = (c - rc) - (r - rr)
    if cfg.loss == "sigmoid":
        return -F.logsigmoid(b * m)
    if cfg.loss == "robust":
        return (-(1 - eps) * F.logsigmoid(b * m) + eps * F.logsigmoid(-b * m)) / (1 - 2 * eps)
    if cfg.loss == "hinge":
        return torch.relu(1 - b * m)
    if cfg.loss == "ipo":
        return ((c - rc) / nc - (r - rr) / nr - 1 / (2 * b)) ** 2
    raise AssertionError(cfg.loss)


@pytest.mark.parametrize("loss,eps", [("sigmoid", 0.0), ("robust", 0.0), ("robust", 0.2), ("hinge", 0.0),
                                      ("ipo", 0.0)])
def test_each_loss_is_its_formula_and_adds_up_over_micro_batches(loss, eps):
    cfg = DPOConfig(loss=loss, beta=0.3, label_smoothing=eps)
    losses, targets, ref = batch(pairs=4)
    want = hand(cfg, losses, targets, ref).mean()
    whole, sums = PreferenceLoss(cfg)(losses, targets, ref, (4.0, 0.0))
    assert float(whole) == pytest.approx(float(want), rel=1e-6)
    parts = [PreferenceLoss(cfg)(losses[i:i + 2], targets[i:i + 2], ref[i:i + 2], (4.0, 0.0)) for i in (0, 2, 4, 6)]
    assert float(sum(p[0] for p in parts)) == pytest.approx(float(want), rel=1e-6)
    assert sum(as_floats(p[1])["loss"] for p in parts) / 4 == pytest.approx(float(want), rel=1e-6)
    logp = -losses.sum(-1)
    rewards = cfg.beta * (logp - ref)
    metrics = pair_metrics(as_floats(sums))
    assert metrics["rewards/chosen"] == pytest.approx(float(rewards[0::2].mean()), rel=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(float((rewards[0::2] - rewards[1::2]).mean()), rel=1e-6)
    assert metrics["rewards/accuracies"] == float((rewards[0::2] > rewards[1::2]).float().mean())
    assert metrics["logps/rejected"] == pytest.approx(float(logp[1::2].mean()), rel=1e-6)


def test_policy_equal_to_reference_gives_ln2_and_zero_rewards():
    losses, targets, _ = batch(pairs=3)
    ref = -losses.sum(-1)
    loss, sums = PreferenceLoss(DPOConfig())(losses, targets, ref, (3.0, 0.0))
    assert float(loss) == pytest.approx(math.log(2), rel=1e-7)
    assert pair_metrics(as_floats(sums))["rewards/margins"] == 0.0


def test_filler_pairs_take_no_part():
    cfg = DPOConfig()
    losses, targets, ref = batch(pairs=4, empty=2)
    assert counts(targets)[0] == 2
    got, sums = PreferenceLoss(cfg)(losses, targets, ref, (2.0, 0.0))
    want = hand(cfg, losses[:4], targets[:4], ref[:4]).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-6) and as_floats(sums)["pairs"] == 2


def test_orpo_equals_trl_odds_ratio_and_nll():
    pytest.importorskip("trl")
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    cfg = DPOConfig(loss="orpo", beta=0.25)
    losses, targets, _ = batch(pairs=4)
    losses = losses / 4  # per-token log-probabilities above -1, as a trained model's are
    n = (targets != IGNORE_INDEX).sum(-1).float()
    avg = -losses.sum(-1) / n
    fake = SimpleNamespace(beta=cfg.beta, accelerator=SimpleNamespace(device="cpu"))
    ratio_losses, chosen_r, rejected_r, *_ = ORPOTrainer.odds_ratio_loss(fake, avg[0::2], avg[1::2])
    chosen_tokens = n[0::2].sum()
    nll = losses[0::2].sum() / chosen_tokens  # CrossEntropyLoss's mean over the chosen tokens
    want = nll - ratio_losses.mean()
    got, sums = PreferenceLoss(cfg)(losses, targets, None, (4.0, float(chosen_tokens)))
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    metrics = pair_metrics(as_floats(sums))
    assert metrics["rewards/chosen"] == pytest.approx(float(chosen_r.mean()), rel=1e-6)
    assert metrics["rewards/rejected"] == pytest.approx(float(rejected_r.mean()), rel=1e-6)
    assert metrics["nll_loss"] == pytest.approx(float(nll), rel=1e-6)


def test_a_reference_loss_without_a_reference_is_refused():
    losses, targets, _ = batch()
    with pytest.raises(ValueError, match="reference"):
        PreferenceLoss(DPOConfig())(losses, targets, None, (4.0, 0.0))


@pytest.mark.parametrize("kind", ["gpt", "gpt2"])
def test_dropout_is_disabled_as_trl_disables_it(kind, tmp_path):
    """`dpo.disable_dropout` (on by default): the policy's forward in training mode is the same
    every time, as in eval mode: no dropout module and no attention dropout rate is left."""
    import transformers as tf

    from rayzero.objectives.dpo import disable_dropout

    torch.manual_seed(0)
    if kind == "gpt":
        from rayzero.models.config import ModelConfig
        from rayzero.models.gpt import build_model

        model = build_model(ModelConfig(dropout=0.2, n_layer=2, n_embd=32, n_head=4, vocab_size=64), 16, seed=0)
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                                 attn_pdrop=0.2, resid_pdrop=0.2, embd_pdrop=0.2))
    model.train()
    x = torch.randint(0, 64, (2, 16))

    def out():
        y = model(x)
        return getattr(y, "logits", y)

    assert not torch.equal(out(), out()), "dropout is on before"
    disable_dropout(model)
    assert torch.equal(out(), out())
    model.eval()
    with torch.no_grad():
        want = out()
    model.train()
    with torch.no_grad():
        assert torch.equal(out(), want)
