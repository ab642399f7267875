"""What a rank holds, by category, in bytes: the ledger behind `memory.bytes_per_param`.

Persistent model state is counted where it is allocated; transient buffers (gathered units,
full gradient buckets, communication casts) are counted while they live, and their peak kept.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

# frozen_params: parameters with requires_grad=False, which have no gradient, main copy or
# optimizer state.
CATEGORIES = ("compute_params", "main_params", "optimizer", "grads", "frozen_params")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class MemoryLedger:
    persistent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    transient: int = 0
    transient_peak: int = 0

    def hold(self, category: str, nbytes: int) -> None:
        self.persistent[category] += nbytes

    def grow(self, nbytes: int) -> None:
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    def shrink(self, nbytes: int) -> None:
        self.transient -= nbytes

    def report(self) -> dict[str, int]:
        return {**self.persistent, "total": sum(self.persistent.values()),
                "transient_peak": self.transient_peak}


def bytes_per_param(reports: list[dict[str, int]], num_params: int) -> dict[str, float]:
    """Each category's bytes per model parameter, the max over ranks."""
    keys = [*CATEGORIES, "total"]
    return {k: max(r[k] for r in reports) / num_params for k in keys}


def formula_bytes_per_param(strategy: str, d: int, param_bytes: int = 4, grad_bytes: int = 4,
                            d_optim: int | None = None) -> float:
    """Megatron's model-state bytes per parameter with d data-parallel ranks (fp32 main
    parameters and two fp32 Adam moments; a separate main copy only when params are not fp32).
    `d_optim`: ranks the optimizer state is split over when that differs from d (Hybrid-FSDP
    shards it across the replicas too)."""
    main = 0 if param_bytes == 4 else 4
    p, g, o = param_bytes, grad_bytes, 8 + main
    o_shard = o / (d_optim or d)
    return {
        "no_shard": p + g + o,
        "optim": p + g + o_shard,
        "optim_grads": p + g / d + o_shard,
        "optim_grads_params": (p + g) / d + o_shard,
    }[strategy]


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Every distinct tensor storage alive in this process on `device_type`, in bytes: an
    independent count to hold the ledger against (tensors autograd or torch keep included).
    Objects a rank process froze at its start (`membership.collect_and_freeze`) are not seen: take
    a baseline in the process and count the difference."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # half-built objects and tensor subclasses that refuse introspection
            continue
    return sum(seen.values())


@dataclass(frozen=True)
class ActivationShape:
    """What the activation estimate needs of a model: its transformer layers' sizes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # the MLP's inner width a token goes through (a mixture of experts: its active experts')
    gated: bool  # SwiGLU-style MLP: gate and up projections
    rms_norm: bool  # RMSNorm (keeps its normalized input too), else LayerNorm
    vocab: int
    fused_attention: bool = True  # SDPA / flash attention: no [heads, seq, seq] scores kept
    dropout: float = 0.0


def activation_bytes(shape: ActivationShape, seq: int, micro_batch: int, elem_bytes: int = 4, every: int = 0,
                     selective: bool = False, tp: int = 1, sequence_parallel: bool = False,
                     vocab_parallel: bool = False) -> int:
    """What one micro-batch's forward keeps for backward, estimated from the model's shape.

    Korthikanti et al. 2022 count a transformer layer's saved activations as s·b·h·(34 + 5·a·s/h)
    bytes in 16-bit (the 5·a·s/h term: attention scores, their softmax and its dropout mask);
    here the same count per tensor, generalized: in elements, times the compute dtype's bytes
    (4 for fp32); with fused attention (SDPA, flash) no scores are kept; grouped-query attention
    keeps smaller keys and values; an MLP of inner width f keeps 2f (4f gated); an RMSNorm keeps
    its normalized input besides its input. Per token, per layer:

        norms        2 x (2h, or 3h for RMSNorm)        input and output (+ normalized)
        attention    (2 + 2·kv/a)·h  (+ 2·a·s unfused)   queries, keys, values, output
        MLP          2f, or 4f gated                     the activation's input and output
        dropout      2h bytes where dropout > 0          the residual dropouts' masks

    outside the layers: the final norm and the fp32 log-softmax of the logits (V; with
    `vocab_parallel`, the fp32 softmax of a rank's ceil(V/tp) logits the sharded loss keeps). With
    activation checkpointing a recomputed layer keeps only its input (h); `selective` keeps its
    input and its matrix multiplications' and attention's outputs.

    With `tp` tensor-parallel ranks (Korthikanti's s·b·h·(10 + 24/t + 5·a·s/(h·t))), a rank
    keeps its heads' queries, keys, values and outputs (key/value heads fewer than the ranks:
    one of each) and its share of the MLP's width; the norms' tensors, the residual dropouts'
    masks and (unless `vocab_parallel`) the logits stay whole. With `sequence_parallel` the norms'
    inputs, the dropout masks and a recomputed block's input are a rank's sequence shard
    (1/tp), and a norm's output is kept as the gathered whole the next layer multiplies (h per
    token; the shard itself is not kept).

    Not counted: what a recompute holds while it runs (one layer's activations, inside backward), attention-probability
    dropout masks, the embeddings' and loss's small index tensors, and allocator overhead."""
    s, b, h = seq, micro_batch, shape.hidden
    tokens = s * b
    norm = 3 * h if shape.rms_norm else 2 * h
    kv = max(shape.kv_heads / tp, 1) / shape.heads  # this rank's key/value heads, over all query heads
    q = h / tp  # this rank's queries (and attention output)
    attention = 2 * q + 2 * kv * h + (0 if shape.fused_attention else 2 * shape.heads * s / tp)
    ffn = shape.ffn / tp
    mlp = (4 if shape.gated else 2) * ffn
    sp = tp if sequence_parallel else 1  # what the sequence shards divide
    # with sequence parallelism a norm's output shard is not kept: the gathered whole is (h)
    norm_kept = (norm - h) / sp + h if sequence_parallel else norm
    norms = 2 * norm_kept
    full_layer = tokens * ((norms + attention + mlp) * elem_bytes + (2 * h / sp if shape.dropout else 0))
    kept = h / sp + q + 2 * kv * h + q + h / sp + ((2 if shape.gated else 1) * ffn + h / sp)  # selective's
    recomputed_layer = tokens * elem_bytes * (kept if selective else h / sp)
    n_recomputed = 0 if not every else (shape.layers + every - 1) // every
    layers = n_recomputed * recomputed_layer + (shape.layers - n_recomputed) * full_layer
    vocab = -(-shape.vocab // tp) if vocab_parallel else shape.vocab  # a rank's logits
    outside = tokens * (norm_kept * elem_bytes + 4 * vocab)
    return int(layers + outside)
