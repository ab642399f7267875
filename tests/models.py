"""Tiny real models for the tests: Hugging Face causal LMs built from their config classes and
saved with `save_pretrained` (no hub), and a user's own `nn.Module`, importable as
`tests.models:TinyLM` for `model.factory`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 320  # the byte datasets use 257 ids


def hf_config(arch: str, **extra):
    """A tiny config of each architecture the tests cover."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    decoder = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128)
    cls, kw = {
        "llama": (tf.LlamaConfig, {**decoder, "tie_word_embeddings": True}),
        "llama-untied": (tf.LlamaConfig, {**decoder, "tie_word_embeddings": False}),
        "qwen2": (tf.Qwen2Config, {**decoder, "tie_word_embeddings": False}),
        "mistral": (tf.MistralConfig, {**decoder, "sliding_window": None}),
        "gpt2": (tf.GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)),
        # transformers picks CohereTokenizer for it from config.json (as Qwen2Tokenizer for qwen2, GPT2Tokenizer
        # for gpt2), with special tokens of its own
        "cohere": (tf.CohereConfig, {**decoder, "logit_scale": 1.0}),
        # Checkpoints whose layout differs from the model's (transformers' weight conversions): GPT-NeoX
        # renames its head (embed_out); the mixtures of experts keep one tensor per expert on disk and one
        # fused parameter per layer in the model. The router loss is weighted up to show in a short run.
        "gpt_neox": (tf.GPTNeoXConfig, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=128,
                                             hidden_dropout=0.0, attention_dropout=0.0)),
        # decoder families whose embedding or norms differ: Gemma scales its embeddings by sqrt(hidden) in
        # the model's forward; Phi has a dropout after them and a LayerNorm with biases
        "gemma": (tf.GemmaConfig, {**decoder, "head_dim": 8}),
        "phi": (tf.PhiConfig, {**decoder, "num_key_value_heads": 4, "partial_rotary_factor": 0.5}),
        "mixtral": (tf.MixtralConfig, {**decoder, "intermediate_size": 48, "num_local_experts": 4,
                                       "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}),
        "qwen2_moe": (tf.Qwen2MoeConfig, {**decoder, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                                          "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                                          "router_aux_loss_coef": 0.02}),
    }[arch]
    return cls(**{**common, **kw, **extra})


def save_hf_model(arch: str, path: str | Path, dtype: torch.dtype = torch.float32, seed: int = 0,
                  max_shard_size: str | None = None, **extra) -> Path:
    """A model of `arch` with random weights (under `seed`) saved to `path` as a model directory."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch, **extra), dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(str(path), **kwargs)
    return Path(path)


def save_tokenizer(path: str | Path, texts: list[str], vocab: int = 300,
                   special: tuple[str, ...] = ("<s>", "</s>"), every_byte: bool = False) -> None:
    """A byte-level BPE tokenizer trained on `texts`, saved as tokenizer.json in `path`;
    `special`: its special tokens, ids 0, 1, ... in order; `every_byte`: all 256 byte symbols
    in the vocabulary (as real tokenizers have), not only those `texts` use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if every_byte else []
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(special),
                                                       initial_alphabet=alphabet))
    tok.save(str(Path(path) / "tokenizer.json"))


# The ChatML template Qwen2's instruct models carry; an answer ends with <|im_end|>.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2


def save_chat_model(path: str | Path, texts: list[str], arch: str = "qwen2") -> Path:
    """A tiny chat model as an instruct model ships: its config (end of sequence = <|im_end|>),
    a BPE tokenizer trained on `texts` with ChatML's special tokens and template, and a
    generation config that ends at <|im_end|> or <|endoftext|>."""
    import json

    path = save_hf_model(arch, path, vocab_size=384, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    save_tokenizer(path, texts, vocab=380, special=CHAT_SPECIAL, every_byte=True)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}))
    return path


def causal_attention(q, k, v, dropout_p: float = 0.0, documents=None):
    """Causal attention; with `documents` (where each token's example starts in its row), within
    each example only: key j for query i when documents[i] <= j <= i."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    index = torch.arange(q.shape[2], device=q.device)
    mask = (index[None, :] <= index[:, None])[None] & (index[None, None, :] >= documents[:, :, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout_p)


class Block(nn.Module):
    """A pre-norm block whose attention's weights are torch's `nn.MultiheadAttention`'s, its
    heads' attention `attend` (causal SDPA; `TinyLM.context_parallel` swaps it). Not MHA's own
    forward: in eval mode without gradients that takes a fused fast path whose bf16 rounding
    differs from the training path's, so a reference model would not start equal to its policy."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.attend = causal_attention

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self._attention(self.ln1(x), document_ids))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))

    def _attention(self, h: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = F.linear(h, self.attn.in_proj_weight, self.attn.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.attn.num_heads, -1).transpose(1, 2) for z in (q, k, v))
        drop = self.attn.dropout if self.training else 0.0
        y = self.attend(q, k, v, drop) if document_ids is None else self.attend(q, k, v, drop, documents=document_ids)
        return self.attn.out_proj(y.transpose(1, 2).reshape(b, t, d))


class TinyLM(nn.Module):
    """A user's own decoder: torch layers only, a non-persistent position buffer, optionally a
    tied head. Forward: token ids [B, T] -> logits [B, T, V]; packed rows' examples kept apart by
    `position_ids` and `document_ids` (rayzero's keywords for them)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, n_layer: int = 2, max_len: int = 128,
                 tie: bool = True, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.register_buffer("positions", torch.arange(max_len), persistent=False)
        self.layers = nn.ModuleList(Block(dim, heads, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def context_parallel(self, attend, positions) -> None:
        """rayzero's hook for context parallelism: attention across the split, global positions."""
        for layer in self.layers:
            layer.attend = attend
        self.global_positions = positions

    global_positions = None

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = self.positions[:t] if self.global_positions is None else self.global_positions(t, idx.device)
        x = self.emb(idx) + self.pos(pos if position_ids is None else position_ids)
        for layer in self.layers:
            x = layer(x) if document_ids is None else layer(x, document_ids)
        return self.head(self.ln_f(x))


class RaisesInTraining(TinyLM):
    """A forward that raises once it computes (its shape probe on the meta device passes): an
    error in the user's training code."""

    def forward(self, idx, **kwargs):
        if idx.device.type != "meta":
            raise ValueError("the model's own forward failed")
        return super().forward(idx, **kwargs)


class Scaled(nn.Module):
    """A module with a parameter no `reset_parameters` initializes (its value comes from its
    constructor)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.gain = nn.Parameter(torch.full((dim,), 0.5))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        return self.head(self.emb(idx) * self.gain)


class WrongShape(nn.Module):
    """A forward that returns [B, V] (the last position only), not [B, T, V]."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        return self.head(self.emb(idx))[:, -1]


def not_a_module(**_):
    return "a string"


class Experts(nn.Module):
    """A mixture's experts as 3-D tensors, one slice per expert (what expert parallelism splits)."""

    def __init__(self, num: int, dim: int, inner: int):
        super().__init__()
        self.num = num
        self.up = nn.Parameter(torch.empty(num, inner, dim))
        self.down = nn.Parameter(torch.empty(num, dim, inner))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.up, std=0.2)
        nn.init.normal_(self.down, std=0.2)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.up[e])), self.down[e])

    def run(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts this module holds on `x`, its rows grouped by expert (`counts[e]` each)."""
        outs, at = [], 0
        for e, c in enumerate(counts):
            outs.append(self.expert(e, x[at:at + c]))
            at += c
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num):
            token, choice = torch.where(index == e)
            out = out.index_add(0, token, self.expert(e, x[token]) * weights[token, choice, None])
        return out


class MoEBlock(Block):
    """TinyLM's block with a top-2 mixture of experts for its MLP."""

    def __init__(self, dim: int, heads: int, experts: int = 4):
        super().__init__(dim, heads)
        del self.fc, self.proj
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, 2 * dim)
        self.route = None  # expert parallelism's dispatch, when `TinyMoE.expert_parallel` sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln1(x))
        h = self.ln2(x)
        b, t, d = h.shape
        flat = h.reshape(-1, d)
        weights, index = torch.topk(torch.softmax(self.router(flat), -1), 2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.route is None:
            out = self.experts(flat, index, weights)
        else:
            out = self.route(flat, index, weights, self.experts.run, self.experts.num)
        return x + out.view(b, t, d)


class TinyMoE(TinyLM):
    """TinyLM with mixture-of-experts blocks, and rayzero's hook for expert parallelism."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, n_layer: int = 2, experts: int = 4):
        super().__init__(vocab, dim, heads, n_layer)
        self.layers = nn.ModuleList(MoEBlock(dim, heads, experts) for _ in range(n_layer))

    def expert_parallel(self, ep) -> dict[str, tuple[int, ...]]:
        whole = {}
        for i, layer in enumerate(self.layers):
            e = layer.experts
            mine = ep.experts(e.num)
            for name in ("up", "down"):
                p = getattr(e, name)
                whole[f"layers.{i}.experts.{name}"] = tuple(p.shape)
                setattr(e, name, nn.Parameter(torch.empty((len(mine), *p.shape[1:]), dtype=p.dtype, device=p.device)))
            layer.route = ep.run
        return whole
