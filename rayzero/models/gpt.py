"""A GPT decoder in plain torch: token + position embeddings, pre-norm blocks, tied head.

The model knows nothing of parallelism. Each parameter's initial value is a function of the
seed and its name alone (`init_parameter`), so any rank can initialize any piece of the model,
one unit at a time, and every world size and strategy starts from the same weights.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayzero.models.config import GPT_DEFAULTS, PRESETS, ModelConfig
from rayzero.models.spec import ModelSpec, config_hash, weights_record
from rayzero.sharding.flat_buffer import FillSource, ParamSource

__all__ = ["GPT", "GPTSpec", "ModelConfig", "PRESETS", "build_model"]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence on this rank; with `documents` (packed rows:
    where each token's example starts, `data/microbatch.py`), each query attends to the keys of
    its own example only, from its start to itself: on the CPU each example's causal attention
    alone (its bounds read from the host tensor, no sync), elsewhere (and inside a compiled block)
    one call with the examples' mask."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if documents.device.type == "cpu" and not torch.compiler.is_compiling():
        return by_example(q, k, v, dropout_p, documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=example_mask(documents), dropout_p=dropout_p)


def by_example(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               documents: torch.Tensor) -> torch.Tensor:
    """Each row's examples' causal attention, one example at a time: the work of the examples'
    own triangles, not the whole row's (measured on one CPU thread, 4 rows of 1,024 tokens, about
    4 examples a row: 0.84x of the whole row's causal attention, 0.58x of one call with the mask)."""
    t, rows = q.shape[2], []
    for r, starts in enumerate(documents.tolist()):
        bounds = sorted(set(starts)) + [t]
        rows.append(torch.cat([F.scaled_dot_product_attention(q[r:r + 1, :, a:b], k[r:r + 1, :, a:b], v[r:r + 1, :, a:b],
                                                              dropout_p=dropout_p, is_causal=True)
                               for a, b in zip(bounds, bounds[1:])], dim=2))
    return torch.cat(rows)


def example_mask(documents: torch.Tensor) -> torch.Tensor:
    """The [B, 1, T, T] boolean mask of causal attention within each example of packed rows: key
    j is allowed for query i when documents[i] <= j <= i."""
    t = documents.shape[-1]
    index = torch.arange(t, device=documents.device)
    return ((index[None, :] <= index[:, None])[None] & (index[None, None, :] >= documents[:, :, None]))[:, None]


class CausalSelfAttention(nn.Module):
    attend = staticmethod(causal_attention)  # (q, k, v, dropout_p) -> y; the model seam may swap it

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        # Head counts follow from the shapes, so a tensor-parallel rank (its share of the
        # heads in q|k|v) runs the same code.
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = self.attend(q, k, v, drop) if documents is None else self.attend(q, k, v, drop, documents=documents)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, -1))


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

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), documents)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int):
        super().__init__()
        self.cfg = cfg
        self.block_size = block_size
        # Storage given, so that the embeddings skip their own init (`init_parameters` sets every
        # value): on the meta device its normal_ would import torch._dynamo, 1.4 s of start-up.
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, _weight=torch.empty(cfg.vocab_size, cfg.n_embd))
        self.wpe = nn.Embedding(block_size, cfg.n_embd, _weight=torch.empty(block_size, cfg.n_embd))
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

    def positions(self, t: int, device) -> torch.Tensor:
        """The positions of the `t` tokens of `idx` (the model seam may give others: a part of a
        longer sequence)."""
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size {self.block_size}")
        return torch.arange(t, device=device)

    def forward(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, time, vocab). `documents` (packed rows, `data/microbatch.py`):
        each token attends within its example only, and its position restarts there."""
        pos = self.positions(idx.shape[1], idx.device)
        if documents is not None:
            pos = pos - documents
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x) if documents is None else block(x, documents)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


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


class GPTSpec(ModelSpec):
    """The built-in GPT behind the model seam: `init_parameter` as its init, its blocks,
    embeddings, norms and head as ZeRO-3 units; or, with `model.path`, weights to start from."""

    kind = "gpt"
    UNITS = ("Block", "Embedding", "LayerNorm", "Linear")

    def __init__(self, cfg: ModelConfig, seed: int, block_size: int, storage_cfg=None):
        super().__init__(cfg, seed, storage_cfg)
        self.block_size = block_size

    @classmethod
    def create(cls, cfg: ModelConfig, *, seed: int, block_size: int, storage_cfg=None, factory=None,
               record: dict | None = None) -> GPTSpec:
        return cls(cfg, seed, block_size, storage_cfg)

    @classmethod
    def context_length(cls, cfg: ModelConfig, storage_cfg=None) -> int | None:
        """`model.block_size`, else the rows of the position embedding in the weights it starts from."""
        if cfg.block_size:
            return cfg.block_size
        from rayzero.models.spec import pretrained_weights

        weights = pretrained_weights(cfg, storage_cfg)
        info = weights.tensors.get("wpe.weight") if weights is not None else None
        return int(info.shape[0]) if info is not None else None

    @classmethod
    def adapter_base_kind(cls, base: Path) -> str:
        """An adapter on a directory with a config.json was trained on an HF model: the kind
        left at its default (this one) gives way to `hf`."""
        return "hf" if (base / "config.json").is_file() else cls.kind

    @classmethod
    def describe(cls, record: dict) -> str:
        config = record.get("config") or {}
        shape = ", ".join(f"{k} {config[k]}" for k in ("n_layer", "n_head", "n_embd", "vocab_size") if k in config)
        return "the built-in GPT" + (f" ({shape})" if shape else "") + (
            f" from {record['source']}" if record.get("source") else "")

    @classmethod
    def plan_line(cls, entry: dict) -> str:
        return "the built-in GPT" + (f", from {entry['source']}" if entry["source"] else "")

    def _build(self) -> GPT:
        return build_model(self.cfg, self.block_size, self.seed, device="meta")

    def logits(self, model: GPT, batch):
        return model(batch.tokens) if batch.documents is None else model(batch.tokens, batch.documents)

    def seeded(self, model: GPT) -> ParamSource:
        return FillSource(lambda name, out: model.init_parameter(name, out, self.seed))

    def fsdp_units(self, model) -> tuple[str, ...]:
        return self.UNITS

    def blocks(self, model) -> tuple[str, ...]:
        return ("Block",)

    def sequence_ends(self, model) -> tuple[str, str]:
        return "blocks.0", "ln_f"

    def vocab_ends(self, model) -> tuple[str, str]:
        return "wte", "lm_head"

    def tp_plan(self, model) -> dict:
        """Megatron's split of a GPT block: q|k|v column-parallel part by part (each rank its
        heads of each), the attention output row-parallel; the MLP's fc column-, proj row-parallel."""
        from rayzero.sharding.tensor_parallel import Style

        return {"blocks.*.attn.qkv": Style("column", parts=3, heads=self.cfg.n_head),
                "blocks.*.attn.proj": Style("row"),
                "blocks.*.mlp.fc": Style("column"),
                "blocks.*.mlp.proj": Style("row")}

    splits_sequence = True

    def context_parallel(self, model, cp) -> None:
        """Every block's attention across the split, and the tokens' global positions (the learned
        position embedding takes them); a tensor-parallel rank's heads are its share."""
        cp.check_heads(self.cfg.n_head, self.cfg.n_head)
        for m in model.modules():
            if isinstance(m, CausalSelfAttention):
                m.attend = cp.attend
        gpt = next(m for m in model.modules() if isinstance(m, GPT))
        gpt.positions = cp.local_positions

    def attention_shape(self, model) -> tuple[int, int]:
        return self.cfg.n_layer, self.cfg.n_embd

    def activation_shape(self, model):
        from rayzero.sharding.memory import ActivationShape

        c = self.cfg
        return ActivationShape(layers=c.n_layer, hidden=c.n_embd, heads=c.n_head, kv_heads=c.n_head,
                               ffn=4 * c.n_embd, gated=False, rms_norm=False, vocab=c.vocab_size, dropout=c.dropout)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def check(self, seq_len: int, data_vocab: int | None = None) -> None:
        super().check(seq_len, data_vocab)
        if self.weights is not None:
            self.resolve(self.build())

    def record(self) -> dict:
        config = self.cfg.model_dump(include=set(GPT_DEFAULTS))
        return {"kind": self.kind, "config": config, "block_size": self.block_size, "seed": self.seed,
                "config_sha256": config_hash({**config, "block_size": self.block_size}),
                **weights_record(self.weights, self.cfg.path), **self.adapter_record()}



