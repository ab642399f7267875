"""Configuration of the sharding strategy, its precision policy, and the optimizer it runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rayzero._frozen import Frozen

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
Dtype = Literal["fp32", "bf16", "fp16"]


class ShardingConfig(Frozen):
    """How parameters, gradients and optimizer state are split across the ranks, and the
    precision each is kept and communicated in. Main parameters and optimizer state are always
    fp32."""

    strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = Field(
        default="optim",
        description="What is sharded: `no_shard` = DDP, `optim` = ZeRO-1 (optimizer state), `optim_grads` "
        "= ZeRO-2 (and gradients), `optim_grads_params` = ZeRO-3 / FSDP (and parameters).",
    )
    bucket_numel: int | Literal["auto"] = Field(
        default="auto",
        description="Elements per communication bucket before padding. `auto`: about 8 buckets over the "
        "trainable parameters, at least 32K elements per rank (512K on CPU ranks, whose gloo reductions have no "
        "spare core to overlap backward on) and at most 4M (1M per rank in a larger group), so gradient "
        "reduction overlaps backward for small models as for large ones. ZeRO-3 makes each FSDP unit a bucket "
        "instead.",
    )
    shard_align: int = Field(
        default=64, ge=1,
        description="Each rank's shard of a bucket starts aligned to this many elements.",
    )
    overlap_grad_reduce: bool = Field(
        default=True,
        description="Start each bucket's gradient reduction as soon as backward completes it.",
    )
    overlap_param_gather: bool = Field(
        default=True,
        description="Forward waits per bucket (per unit with ZeRO-3) for its parameter all-gather instead "
        "of for all of them: each module at its start for its own parameters' buckets, and for those of "
        "parameters it reads without calling their module (found in the first forward after a gather).",
    )
    fsdp_units: tuple[str, ...] = Field(
        default=(),
        description="ZeRO-3: module classes that become FSDP units (outermost wins), comma-separated on the "
        "command line. Empty = the model's own: for the built-in GPT each block, the two embeddings, the final "
        "norm and the (tied) head; for an HF model the classes in its `_no_split_modules` (its decoder "
        "layer); for a module the class of its largest `nn.ModuleList`'s layers.",
    )
    dp_outer: int = Field(
        default=1, ge=1,
        description="Hybrid sharding, replicas x shards: above 1, the ranks form `dp_outer` replicas and "
        "shard within each; must divide `cluster.num_workers`. 1 = no hybrid.",
    )
    outer_strategy: Literal["no_shard", "optim"] = Field(
        default="no_shard",
        description="Hybrid sharding across the replicas: `no_shard` all-reduces gradients (HSDP), `optim` "
        "also shards the optimizer state across them (Hybrid-FSDP).",
    )
    param_dtype: Dtype = Field(
        default="fp32",
        description="Compute parameters: what forward and backward run in.",
    )
    grad_dtype: Dtype = Field(
        default="fp32",
        description="Gradient accumulation dtype.",
    )
    comm_dtype: Dtype | None = Field(
        default=None,
        description="Gradient communication dtype; `null` = `grad_dtype`.",
    )
    loss_scale: Literal["auto", "dynamic", "none"] | float = Field(
        default="auto",
        description="Loss scaling: `auto` = `dynamic` for fp16 parameters, `none` otherwise; a number is a "
        "fixed scale.",
    )
    initial_loss_scale: float = Field(
        default=2.0**16, gt=0,
        description="Starting scale of dynamic loss scaling.",
    )
    loss_scale_window: int = Field(
        default=1000, ge=1,
        description="Dynamic loss scaling: consecutive finite steps before the scale doubles (it halves on "
        "an overflow).",
    )

    @field_validator("fsdp_units", mode="before")
    @classmethod
    def _split(cls, v):
        # From the command line: sharding.fsdp_units=Block,Embedding
        return tuple(s.strip() for s in v.split(",") if s.strip()) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self):
        if self.bucket_numel != "auto" and self.bucket_numel < 1:
            raise ValueError(f"bucket_numel: must be `auto` or at least 1, got {self.bucket_numel}")
        if self.dp_outer > 1 and self.strategy == "no_shard":
            raise ValueError("dp_outer: hybrid sharding needs a sharded strategy, got no_shard")
        if self.param_dtype == "fp16" and self.loss_scale == "none":
            raise ValueError(
                "loss_scale: fp16 parameters need loss scaling (set sharding.loss_scale=dynamic or a number)"
            )
        return self

    @property
    def effective_comm_dtype(self) -> str:
        return self.comm_dtype or self.grad_dtype


class ParallelConfig(Frozen):
    """Model parallelism inside each data-parallel rank."""

    tp: int = Field(
        default=1, ge=1,
        description="Tensor-parallel size: each attention and MLP block is split Megatron style across this many "
        "consecutive ranks (column-parallel, then row-parallel linears; attention heads split, key/value heads "
        "split or, when there are fewer of them than ranks, replicated), which see the same micro-batches. The "
        "strategy shards each rank's part over the data-parallel ranks. The world is `pp` x `sharding.dp_outer` x "
        "shards x `ep` x `cp` x `tp` ranks; 1 = no tensor parallelism.",
    )
    sequence_parallel: bool = Field(
        default=False,
        description="Megatron's sequence parallelism (needs `tp` > 1): between the tensor-parallel regions the "
        "activations are split along the sequence over the TP ranks, so norms, residuals and dropout keep 1/tp "
        "of theirs; the all-reduces become all-gathers and reduce-scatters. `train.seq_len` must divide by `tp`.",
    )
    vocab_parallel: bool = Field(
        default=True,
        description="With `tp` > 1, split the input embedding and the output head (one tensor when tied) over the "
        "vocabulary, Megatron style: each TP rank holds ceil(V / tp) rows of them and of the logits, and the "
        "cross-entropy is computed on the logit shards, never on the full logits (a vocabulary `tp` does not divide "
        "is padded; the padding is in no checkpoint or export). `false`, or a model whose embedding or head is not a "
        "plain layer (said before the run starts): replicated on every TP rank, with the full logits on each.",
    )

    cp: int = Field(
        default=1, ge=1,
        description="Context-parallel size: each sequence split over this many ranks, for sequences whose "
        "activations one rank cannot hold. The sequence is cut into 2 x `cp` chunks and rank i of a cp group holds "
        "chunks i and 2 x cp - 1 - i (even causal-attention work), with the tokens' global positions; attention runs "
        "across the split as `cp_mode` says. The ranks of a cp group take the same rows and hold the same weights: "
        "gradients are reduced (and sharded by the strategy) over data-parallel x cp ranks, and the loss is summed "
        "over them. The world is `pp` x `sharding.dp_outer` x shards x `ep` x `cp` x `tp` ranks; `train.seq_len` "
        "must divide by 2 x cp. With tensor (and sequence) and pipeline parallelism, every strategy, recompute, LoRA, preference "
        "tuning (both rows of a pair split alike), dropout (streams per cp rank, attention dropout inside the ring) "
        "and `train.compile`; the built-in GPT, Hugging Face decoders (mixtures of experts too: the load-balancing "
        "loss over the cp group's tokens) and a `module` model with a `context_parallel(attend, positions)` method. "
        "1 = none.",
    )
    ep: int = Field(
        default=1, ge=1,
        description="Expert-parallel size, for a mixture of experts: every MoE layer's experts split over this many "
        "ranks (each holds E / ep of them; the tokens are sent to their experts' ranks by all-to-all and back). "
        "Folded into the data-parallel ranks: they take different rows and the dense parameters are sharded "
        "over them as over any data-parallel rank, while the experts' bucket group is reduced and sharded over "
        "the ranks holding the same experts (data-parallel / ep). Must divide the data-parallel size and the "
        "number of experts. 1 = none.",
    )
    cp_mode: Literal["ring", "ulysses"] = Field(
        default="ring",
        description="How attention runs across the cp split: `ring` passes each rank's key/value block round the "
        "cp group point to point while every rank computes on the block it holds, merging by log-sum-exp and "
        "skipping the blocks the causal mask hides (any head count); `ulysses` exchanges by all-to-all to a head "
        "split, attends over the whole sequence, and exchanges back (heads and key/value heads divisible by cp).",
    )
    pp: int = Field(
        default=1, ge=1,
        description="Pipeline-parallel size: the model's blocks split into this many stages, in order (the "
        "embedding on the first, the final norm, head and loss on the last; tied embeddings kept tied across "
        "them), each on its own ranks, micro-batches passed between them by point-to-point sends as "
        "`pp_schedule` orders. The world is `pp` x `sharding.dp_outer` x shards x `ep` x `cp` x `tp` ranks; each "
        "stage shards its own parameters over its data-parallel ranks. 1 = no pipeline.",
    )
    pp_layers: list[int] | None = Field(
        default=None,
        description="With `pp` > 1: how many blocks each stage (each model chunk with "
        "`pp_virtual_stages` > 1, in stage order) holds, e.g. [3, 5]; they must sum to the model's block count. "
        "`null` = balanced by parameter count (the embedding counts to the first stage, the head to the last).",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = Field(
        default="1f1b",
        description="The order in which each stage runs its micro-batches' forwards and backwards: `gpipe` (all "
        "forwards, then all backwards: every micro-batch's activations held), `1f1b` (one forward, one backward: "
        "at most `pp` micro-batches' activations held; bubble (pp-1)/m), `interleaved_1f1b` "
        "(`pp_virtual_stages` model chunks per rank: bubble (pp-1)/(v m); micro-batches per step a multiple of "
        "`pp`), `zero_bubble` (ZB-H1: backward split into its input- and weight-gradient parts, the weight parts "
        "filling the bubble: about a third of 1F1B's at 1F1B's memory). m = micro-batches per rank per step.",
    )
    pp_virtual_stages: int = Field(
        default=1, ge=1,
        description="Model chunks per pipeline rank for `pp_schedule=interleaved_1f1b` (at least 2 there; 1 "
        "otherwise): rank r holds stages r, r + pp, r + 2 pp, …",
    )

    @field_validator("pp_layers", mode="before")
    @classmethod
    def _split_layers(cls, v):
        # From the command line: parallel.pp_layers=3,5 (or [3,5])
        return [s.strip() for s in v.strip("[] ").split(",") if s.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self):
        if self.pp_virtual_stages > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ValueError(f"pp_virtual_stages: {self.pp_virtual_stages} model chunks per rank need "
                             "parallel.pp_schedule=interleaved_1f1b")
        if self.pp_schedule == "interleaved_1f1b" and self.pp > 1 and self.pp_virtual_stages < 2:
            raise ValueError("pp_schedule: interleaved_1f1b needs parallel.pp_virtual_stages of at least 2 "
                             "(model chunks per rank)")
        if self.pp_layers is not None:
            stages = self.pp * self.pp_virtual_stages
            if len(self.pp_layers) != stages:
                raise ValueError(f"pp_layers: {len(self.pp_layers)} entries for {stages} stages (parallel.pp"
                                 + (" x parallel.pp_virtual_stages" if self.pp_virtual_stages > 1 else "")
                                 + f" = {stages}): give one block count per stage")
            if any(n < 1 for n in self.pp_layers):
                raise ValueError(f"pp_layers: {self.pp_layers}: every stage needs at least one block")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel: splits the sequence over tensor-parallel ranks; set parallel.tp > 1")
        return self


class MoEConfig(Frozen):
    """How a mixture of experts routes its tokens under expert parallelism, and what its router's
    loss adds."""

    capacity_factor: float | None = Field(
        default=None, gt=0,
        description="With `parallel.ep` > 1: the most (token, expert) pairs an expert takes from one rank, as a "
        "multiple of an even share, ceil(capacity_factor x pairs / experts); the pairs past it are dropped (their "
        "share of the layer's output is zero) and counted in the metrics. None: dropless, every pair is sent.",
    )
    grouped_mm: bool = Field(
        default=True,
        description="With `parallel.ep` > 1: a rank's experts run on the tokens they received in one grouped "
        "matmul (transformers' `grouped_mm` experts, `torch.nn.functional.grouped_mm`) where torch has one for the "
        "device; false, or where it has none: the family's own loop over the experts.",
    )
    router_z_loss: float = Field(
        default=0.0, ge=0,
        description="The router z-loss's weight in the training loss (ST-MoE's; 1e-3 there): each MoE layer's mean "
        "over tokens of logsumexp(router logits)^2, summed over layers, which keeps the router's logits small. Added "
        "beside the model's load-balancing loss (its `router_aux_loss_coef`, which must be > 0), reported apart "
        "(`router_z_loss` each step, `final_router_z_loss` in the summary). 0: none.",
    )


class OptimConfig(Frozen):
    """AdamW and its learning-rate schedule: linear warmup to `lr`, then `schedule` (cosine
    decay by default) down to `min_lr` at the last step."""

    lr: float = Field(default=3e-3, gt=0, description="Peak learning rate, reached at the end of warmup. A run from "
                      "pretrained weights defaults to 2e-5 (LoRA 2e-4; `train.objective=dpo` 1e-6, LoRA 1e-5).")
    min_lr: float | None = Field(
        default=None, ge=0,
        description="Learning rate at the last step, where the decay ends; `null` = `lr` / 10 (a run from pretrained "
        "weights: 0).",
    )
    warmup_steps: int = Field(
        default=10, ge=0,
        description="Steps of linear warmup up to `lr`; 0 = none (a run from pretrained weights defaults to 0).",
    )
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        default="cosine",
        description="After warmup: `cosine` or `linear` decay to `min_lr` at the last step; `constant` at `lr`; "
        "`wsd` (warmup-stable-decay) at `lr`, then linear decay to `min_lr` over the last `decay_fraction` of "
        "the steps. A run from pretrained weights defaults to `linear`.",
    )
    decay_fraction: float = Field(
        default=0.2, gt=0, le=1,
        description="`wsd`: the fraction of the steps the final decay takes.",
    )
    schedule_total: Literal["original", "new"] = Field(
        default="original",
        description="On a resume with another `train.steps`: `original` keeps the schedule the run started with "
        "(past its end the learning rate stays at `min_lr`); `new` stretches it to the new `train.steps`.",
    )
    weight_decay: float = Field(
        default=0.1, ge=0,
        description="AdamW decoupled weight decay; 0 disables it (a run from pretrained weights defaults to 0).",
    )
    beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW decay rate of the first moment.")
    beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW decay rate of the second moment (a run from "
                         "pretrained weights defaults to 0.999).")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon, added to the denominator.")
    grad_clip: float = Field(
        default=1.0, ge=0,
        description="Clip the global gradient norm to this value; 0 disables clipping.",
    )

    @property
    def final_lr(self) -> float:
        """Where the cosine decay ends."""
        return self.lr / 10 if self.min_lr is None else self.min_lr
