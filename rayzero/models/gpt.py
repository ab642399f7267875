"""A GPT decoder in plain torch: token + position embeddings, pre-norm blocks, tied head.

The model knows nothing of parallelism. Each parameter's initial value is a function of the
seed and its name alone (`init_parameter`), so any rank can initialize any piece of the model,
one unit at a time, and every world size and strategy starts from the same weights.
"""

from __future__ import annotations

import math
import zlib
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, model_validator

from rayzero._frozen import Frozen

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=128),  # ~0.5M parameters: tests, laptops
    "small": dict(n_layer=6, n_head=6, n_embd=384),  # ~10.8M
    "medium": dict(n_layer=12, n_head=12, n_embd=768),  # ~85M, GPT-2 small's shape
    "large": dict(n_layer=24, n_head=16, n_embd=1024),  # ~303M, GPT-2 medium's shape
}


class ModelConfig(Frozen):
    """The GPT decoder's shape. `preset` fills every dimension that is not given explicitly."""

    preset: Literal["tiny", "small", "medium", "large"] = Field(
        default="tiny",
        description="Model size: `tiny` (~0.5M parameters), `small` (~10.8M), `medium` (~85M, GPT-2 small's "
        "shape), `large` (~303M, GPT-2 medium's shape).",
    )
    n_layer: int | None = Field(default=None, description="Transformer blocks; `null` = from `preset`.")
    n_head: int | None = Field(
        default=None,
        description="Attention heads per block; must divide `n_embd`. `null` = from `preset`.",
    )
    n_embd: int | None = Field(default=None, description="Embedding width; `null` = from `preset`.")
    vocab_size: int = Field(
        default=320,
        description="Token vocabulary: 257 byte tokens (256 bytes + end-of-text) padded up to a multiple "
        "of 64; at least the dataset's.",
    )
    block_size: int | None = Field(
        default=None,
        description="Maximum context length in tokens, at least `train.seq_len`; `null` = `train.seq_len`.",
    )
    dropout: float = Field(default=0.0, description="Dropout probability, in [0, 1); 0 disables it.")
    bias: bool = Field(default=True, description="Biases in the linear layers and layer norms.")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data):
        if isinstance(data, dict):
            preset = data.get("preset", "tiny")
            if preset in PRESETS:
                data = {**PRESETS[preset], **{k: v for k, v in data.items() if v is not None}}
        return data

    @model_validator(mode="after")
    def _check(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        return self


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int):
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2

    def init_parameter(self, name: str, out: torch.Tensor, seed: int) -> None:
        """Write the initial value of parameter `name` (as in `named_parameters()`) into `out`.

        GPT-2's scheme: matrices N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)),
        biases 0, norm gains 1. Each parameter draws from its own generator seeded by
        (seed, name), so the value does not depend on what else is initialized, or where.
        """
        if out.dim() == 1:
            out.fill_(1.0 if name.endswith("weight") else 0.0)  # norm gains; biases
            return
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
        # The CPU generator keeps only 32 bits of its seed: hash seed and name together.
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        out.copy_(torch.randn(out.shape, generator=g).mul_(std))

    def init_parameters(self, seed: int) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_parameter(name, p, seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, time, vocab)."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @staticmethod
    def decays(name: str, param: torch.Tensor) -> bool:
        """Matrices decay; biases and norm gains do not (nanoGPT's and Megatron's rule)."""
        return param.dim() >= 2

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N plus attention (PaLM appendix B)."""
        n, c = self.num_params(), self.cfg
        return 6 * n + 12 * c.n_layer * c.n_embd * seq_len


def build_model(cfg: ModelConfig, block_size: int, seed: int, device: str = "cpu") -> GPT:
    """The model with its initial weights; on `device="meta"` only shapes, no storage (a
    sharded strategy then materializes it piece by piece with `init_parameter`)."""
    with torch.device("meta"):
        model = GPT(cfg, block_size)
    if device != "meta":
        model.to_empty(device=device)
        model.lm_head.weight = model.wte.weight  # to_empty gives each module its own tensor
        model.init_parameters(seed)
    return model
