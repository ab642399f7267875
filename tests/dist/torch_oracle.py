"""The plain-torch oracle of `tests/dist/test_combinations.py`'s language-model configurations:
the same model, initial weights and global batches in one process (`torch.optim.AdamW` through
`tests/dist/reference.py`), LoRA through PEFT from the adapters one process computes from the
seed, frozen parameters frozen."""

from __future__ import annotations

import fnmatch

import torch

from tests import combinations as combos
from tests.dist.reference import train_reference
from tests.models import TinyLM

STEPS = combos.STEPS


def torch_oracle(c: dict, cfg, setup: dict) -> dict:
    """Configuration `c` (`cfg`) trained by plain single-process torch: {"state", "losses", "prefs": None, "norms"}."""
    m = combos.MODELS[c["model"]]
    if m["kind"] == "gpt":
        from rayzero.models.gpt import build_model

        model = build_model(cfg.model, cfg.block_size, cfg.train.seed)
    elif m["kind"] == "module":
        from rayzero.workers.assembly import make_spec

        model = TinyLM(n_layer=4)
        spec = make_spec(cfg)
        source = spec.source(spec.build())
        with torch.no_grad():
            for n, p in model.named_parameters():
                source.fill(n, p)
    else:
        import transformers as tf

        model = tf.AutoModelForCausalLM.from_pretrained(setup["dirs"][c["model"]], dtype=torch.float32)
    if c["trainable"] == "frozen":
        for n, p in model.named_parameters():
            p.requires_grad_(not any(fnmatch.fnmatchcase(n, pat) for pat in cfg.model.freeze))
    if c["trainable"] == "lora":
        from peft import LoraConfig, get_peft_model

        lora = cfg.model.lora
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                 target_modules=list(lora.target_modules) or None))
        start = initial_adapters(cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(start[rayzero_name(n)])
    norms: list[float] = []
    state, losses = train_reference(model, cfg, setup["text"], STEPS, norms=norms,
                                    batch=packed_batch(cfg, setup["examples"]) if c["objective"] == "sft" else None)
    return {"state": {rayzero_name(k): v for k, v in state.items()}, "losses": losses, "prefs": None, "norms": norms}


def packed_batch(cfg, data: str):
    """Each step's whole global batch of packed instruction windows, as one rank of one reads
    them: (inputs, targets, where each token's example starts)."""
    from rayzero.data.instruct import InstructionBatches
    from rayzero.data.tokens import TokenDataset

    t = cfg.train
    b = InstructionBatches(TokenDataset(data), seed=t.seed, global_batch=t.global_batch_size,
                           micro_batch=t.global_batch_size, seq_len=t.seq_len, dp_rank=0, dp_size=1)

    def batch(step: int):
        tokens, labels, documents = b.rank_rows(step)
        assert (documents > 0).any(), "the windows must pack several examples for the test to mean anything"
        return tokens[:, :-1], labels[:, 1:], documents[:, :-1]

    return batch


def initial_adapters(cfg) -> dict[str, torch.Tensor]:
    """LoRA's initial adapters as one process computes them, without any group: from the seed and their names."""
    from rayzero.workers.assembly import build_model, initial_values, make_spec

    spec = make_spec(cfg)
    built = build_model(cfg, spec)
    source, out = initial_values(spec, built), {}
    for n in built.added:
        out[n] = torch.empty(built.model.get_parameter(n).shape)
        source.fill(n, out[n])
    return out


def rayzero_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")
