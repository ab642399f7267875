"""The supported-models matrix of docs/reference/models.md, made from what the tests run: each
model family against each feature. A mark means a test trains that family with that feature
and holds it to its reference: the generated configurations of tests/combinations.py (each
against single-process torch, or its world-1 run for the preference losses), and the tests
named in `ELSEWHERE`. A refusal means rayzero refuses the pair before it starts (a rule of the
configurations, each mirroring the refusal's own test). Kept equal to the page by
tests/unit/test_docs.py; `python -m tests.matrix` prints the block."""

from __future__ import annotations

from tests.combinations import MODELS, configs, excluded_pairs
from tests.dist.test_conversions import ARCHS as CONVERTED
from tests.dist.test_pipeline_models import FAMILIES as PIPELINED

YES, REFUSED, NOT_HF = "✓", "refused", "n/a"

# The families, as a user names them: (row, where the tests build it)
FAMILIES = {
    "gpt": "the built-in GPT (`model.kind=gpt`)",
    "module": "your own `nn.Module` (`model.kind=module`)",
    "llama": "Llama, tied embeddings",
    "llama-untied": "Llama, untied head",
    "qwen2": "Qwen2 (biases on q, k, v)",
    "gpt2": "GPT-2 (Conv1D, learned positions)",
    "mixtral": "Mixtral (mixture of experts)",
    "qwen2_moe": "Qwen2-MoE (experts and a shared expert)",
    "mistral": "Mistral",
    "gemma": "Gemma (scaled embedding)",
    "phi": "Phi (partial rotary, LayerNorm with biases)",
    "gpt_neox": "GPT-NeoX (its own head's name)",
}

# A feature: its column, and the axis values of a generated configuration that show it.
FEATURES = {
    "DDP": ("strategy", ["no_shard"]),
    "ZeRO-1": ("strategy", ["optim"]),
    "ZeRO-2": ("strategy", ["optim_grads"]),
    "ZeRO-3": ("strategy", ["optim_grads_params"]),
    "HSDP": ("strategy", ["hsdp"]),
    "Hybrid-FSDP": ("strategy", ["hfsdp"]),
    "TP": ("tp", ["2", "4", "2sp"]),
    "SP": ("tp", ["2sp"]),
    "PP": ("pp", ["gpipe", "1f1b", "interleaved", "zb"]),
    "CP": ("cp", ["ring", "ulysses"]),
    "EP": ("ep", ["2"]),
    "recompute": ("recompute", ["full", "selective", "every:2"]),
    "compile": ("compile", ["aot_eager"]),
    "bf16": ("precision", ["bf16", "bf16-comm"]),
    "LoRA": ("trainable", ["lora"]),
    "SFT": ("objective", ["sft"]),
    "DPO": ("objective", ["dpo", "dpo-precomputed"]),
    "own objective": ("objective", ["own"]),
    "resume": ("resume", [True]),
    "HF export": None,  # not an axis: the tests below
}

# Tests outside the configurations, each with the families it runs and the features it shows:
# (test, families, features). The families are the tests' own lists, imported.
ELSEWHERE = [
    ("tests/dist/test_pipeline_models.py", PIPELINED, ["ZeRO-1", "PP"]),
    ("tests/dist/test_conversions.py", CONVERTED, ["ZeRO-3", "HF export"]),
    ("tests/dist/test_pretrained.py", ["llama-untied"], ["ZeRO-1", "ZeRO-3", "HF export"]),
    ("tests/dist/test_pretrained.py", ["qwen2"], ["resume"]),
    ("tests/e2e/test_models.py", ["llama"], ["HF export", "LoRA"]),
    ("tests/e2e/test_sft_trl.py", ["qwen2"], ["ZeRO-3", "SFT", "LoRA", "HF export"]),
]


def _refused(model: str, axis: str, values: list, excluded: set) -> bool:
    """Whether every value of `axis` that shows the feature breaks a rule with `model`: no valid
    configuration holds the pair."""
    return model in MODELS and all(("model", model, axis, v) in excluded or (axis, v, "model", model) in excluded
                                   for v in values)


def cells() -> dict[str, dict[str, str]]:
    """Per family, per feature: ✓, refused, n/a (not a Hugging Face model) or '' (no test runs it)."""
    table = {family: {f: "" for f in FEATURES} for family in FAMILIES}
    excluded = set(excluded_pairs())
    for c in configs():
        for feature, shown in FEATURES.items():
            if shown is not None and c[shown[0]] in shown[1]:
                table[c["model"]][feature] = YES
    for _, families, features in ELSEWHERE:
        for family in families:
            for feature in features:
                table[family][feature] = YES
    for family, row in table.items():
        for feature, shown in FEATURES.items():
            if row[feature]:
                continue
            if shown is None:
                row[feature] = NOT_HF if MODELS.get(family, {}).get("kind") in ("gpt", "module") else ""
            elif _refused(family, *shown, excluded):
                row[feature] = REFUSED
    return table


# The page's two tables: how the model is split, then how it is trained and kept.
TABLES = (("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "HSDP", "Hybrid-FSDP", "TP", "SP", "PP", "CP", "EP"),
          ("recompute", "compile", "bf16", "LoRA", "SFT", "DPO", "own objective", "resume", "HF export"))
PACKAGES = ("torch", "ray", "transformers", "peft", "trl")


def tested_versions() -> dict[str, str]:
    """Python's and each package's major.minor, as the suite runs them."""
    import platform
    from importlib import metadata

    found = {"python": platform.python_version()}
    found.update({name: metadata.version(name) for name in PACKAGES})
    return {name: ".".join(v.split("+")[0].split(".")[:2]) for name, v in found.items()}


def matrix_block() -> str:
    table = cells()
    lines = []
    for columns in TABLES:
        head = ["family", *columns]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join([FAMILIES[f], *(row[c] for c in columns)]) + " |" for f, row in table.items()]
        lines.append("")
    v = tested_versions()
    lines.append(f"Tested with Python {v['python']}, torch {v['torch']}, Ray {v['ray']}, transformers "
                 f"{v['transformers']}, PEFT {v['peft']} and TRL {v['trl']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(matrix_block())
