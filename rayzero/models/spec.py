"""The model seam: everything model-specific the trainer needs, behind one small interface.

One `ModelSpec` per model kind (the built-in GPT, a Hugging Face causal LM, a user's
`nn.Module`), in the spirit of torchtitan's `TrainSpec`. `Rank`, the strategies, the
checkpoint tools and the CLI ask it, and never name a model class:

    spec.build()                 the model with parameters on the meta device (buffers real)
    spec.source(model)           initial values: a seeded init, or pretrained weights by range
    spec.fsdp_units(model)       the default ZeRO-3 unit classes
    spec.decays(name, p)         which parameters take weight decay
    spec.loss(model, batch)      a micro-batch's summed loss over valid tokens, their count, and
                                 its auxiliary loss if any; packed examples kept each alone
    spec.parallelize(model, ...) tensor parallelism: its plan applied, its vocabulary split
    spec.record()                what a checkpoint notes of the model (kind, source, config hash)
    spec.export_plan(model)      the names an export writes, and what each one holds
    spec.check(seq_len, ...)     what can be checked in the driver, before any cluster starts

What a kind answers before a spec is made (the driver's checks, a checkpoint's record) its
class answers, found by `models.spec_class(kind)`: `model_dir(cfg)`, `takes_factory()`,
`exports_by_names()`, `describe(record)` and the like; what the config's validation asks,
`ModelConfig` answers without torch. Nothing outside `models` tests the kind.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayzero.data.microbatch import MicroBatch
from rayzero.models.errors import ModelError, ModelUnavailable  # noqa: F401 (raised here, named from here too)
from rayzero.models.weights import pretrained_weights, weights_record  # noqa: F401 (named from here too)
from rayzero.sharding.flat_buffer import ParamSource
from rayzero.sharding.vocab_parallel import IGNORE_INDEX  # labels equal to it take no part in the loss


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the targets that are not IGNORE_INDEX, in fp32, and their count."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss, (targets != IGNORE_INDEX).sum()


def summed_nll(logits: torch.Tensor, targets: torch.Tensor, vocab=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_loss` of the logits, on this rank's vocabulary shard where `vocab` splits the head."""
    return vocab.token_loss(logits, targets) if vocab is not None else token_loss(logits, targets)


def per_token_nll(logits: torch.Tensor, targets: torch.Tensor, vocab=None) -> torch.Tensor:
    """Each target's cross-entropy [B, T] in fp32, 0 where it is IGNORE_INDEX (on this rank's
    vocabulary shard where `vocab` splits the head)."""
    if vocab is not None:
        return vocab.token_losses(logits, targets)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(targets.shape)


def check_logits(logits, x: torch.Tensor, where: str) -> torch.Tensor:
    """The forward's output as [B, T, V] logits (a tensor, or an object with `.logits`);
    a ModelError naming the shape otherwise."""
    out = getattr(logits, "logits", logits)
    if not isinstance(out, torch.Tensor):
        raise ModelError(f"{where}: the forward returned {type(logits).__name__}, expected logits "
                         f"[batch, time, vocab] (a tensor, or an object with .logits)")
    if out.dim() != 3 or tuple(out.shape[:2]) != tuple(x.shape):
        raise ModelError(f"{where}: the forward returned shape {list(out.shape)} for input {list(x.shape)}; "
                         f"expected logits [batch, time, vocab] = [{x.shape[0]}, {x.shape[1]}, vocab]")
    return out


@dataclass(frozen=True)
class ExportEntry:
    """One tensor of an export: its name in the file, and the parameter (by checkpoint name)
    or the buffer (a tensor) it holds. `parts`: where the export's layout differs from the
    model's, the boxes of parameters the tensor is made of, as (parameter, `conversions.Part`)
    (a mixture of experts' one expert cut out of a fused parameter; a fused tensor made of
    several parameters)."""

    name: str
    shape: tuple[int, ...]
    param: str | None = None
    buffer: torch.Tensor | None = None
    parts: tuple = ()

    def produce(self, shape_of, read) -> torch.Tensor:
        """The tensor, from `read(param, lo, hi)` (a parameter's flat elements [lo, hi)) and
        `shape_of(param)`."""
        if not self.parts:
            return read(self.param, 0, _prod(self.shape)).view(self.shape)
        out = None
        for param, part in self.parts:
            for p, s, n in part.blocks(shape_of(param)):
                values = read(param, p, p + n)
                if out is None:
                    out = torch.empty(_prod(self.shape), dtype=values.dtype)
                out[s : s + n] = values
        return out.view(self.shape)


def global_shapes(model: nn.Module, skip=frozenset(), shapes: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Each parameter's whole shape (`shapes` for those the model holds a shard of), but `skip`."""
    shapes = shapes or {}
    return {n: tuple(shapes.get(n, p.shape)) for n, p in model.named_parameters() if n not in skip}


class ModelSpec:
    """What the trainer needs to know of one model; see the module docstring."""

    kind = "base"
    block_size: int | None = None  # the context the model is built for, which generation crops to; None: any

    def __init__(self, cfg, seed: int, storage_cfg=None):
        self.cfg = cfg
        self.seed = seed
        self.freeze = tuple(cfg.freeze)
        self.storage_cfg = storage_cfg  # S3 settings for model.path
        self.cp = None  # this rank's `ContextParallel`, once `context_parallel` has split the model

    # -- the kind: what its class answers from a config or a record, with no spec made --------
    @classmethod
    def create(cls, cfg, *, seed: int, block_size: int, storage_cfg=None, factory: Callable | None = None,
               record: dict | None = None) -> ModelSpec:
        """The spec of `cfg` (see `models.model_spec`); `record`: the model's record in the
        checkpoint it is rebuilt from."""
        return cls(cfg, seed, storage_cfg)

    @classmethod
    def takes_factory(cls) -> bool:
        """Whether the model is built by a user's callable (`model.factory`, or one given from Python)."""
        return False

    @classmethod
    def model_dir(cls, cfg) -> str | None:
        """The directory of the model's own files (config.json, generation config, tokenizer:
        the tokenizer its data must be made with), or None where it has none (a model built from
        rayzero's config or a factory; its `model.path` holds weights only)."""
        return None

    @classmethod
    def exports_by_names(cls) -> bool:
        """Whether a checkpoint may be exported by its parameters' names alone where the model
        cannot be rebuilt in this process (a module whose factory was defined in a notebook)."""
        return False

    @classmethod
    def adapter_base_kind(cls, base: Path) -> str:
        """The kind of the model a PEFT adapter goes onto, where the adapter names its base
        (`base`, a local path) and this kind is the one configured."""
        return cls.kind

    @classmethod
    def context_length(cls, cfg, storage_cfg=None) -> int | None:
        """The most positions the model of `cfg` takes (a fine-tune's windows' most), or None."""
        return None

    @classmethod
    def architecture(cls, record: dict) -> str | None:
        """The model's architecture by name, as its record (`record()`) says, or None."""
        return None

    @classmethod
    def describe(cls, record: dict) -> str:
        """A model as a checkpoint records it (`record()`), in a few words."""
        raise NotImplementedError

    @classmethod
    def plan_line(cls, entry: dict) -> str:
        """The model in the dry run's plan, from the plan's `model` entry."""
        what = entry["architecture"] or entry["kind"]
        source = f" from {entry['source']}" if entry["source"] else ""
        return f"{what}{source} ({'pretrained weights' if entry['init'] == 'pretrained' else 'random init'})"

    @functools.cached_property
    def weights(self):
        """The pretrained weights the model starts from (`SafetensorsWeights`), or None."""
        return pretrained_weights(self.cfg, self.storage_cfg)

    # -- building ----------------------------------------------------------------------
    def build(self) -> nn.Module:
        """The model, parameters on the meta device, buffers real, frozen parameters marked."""
        model = self._build()
        if self.freeze:
            names = [n for n, _ in model.named_parameters()]
            unmatched = [pat for pat in self.freeze if not any(fnmatch.fnmatchcase(n, pat) for n in names)]
            if unmatched:
                raise ModelError(f"model.freeze: {', '.join(unmatched)} matches no parameter; the parameters are "
                                 f"{_short_list(names)}")
            for n, p in model.named_parameters():
                if any(fnmatch.fnmatchcase(n, pat) for pat in self.freeze):
                    p.requires_grad_(False)
        return model

    def _build(self) -> nn.Module:
        raise NotImplementedError

    def source(self, model: nn.Module, added: frozenset[str] = frozenset(),
               shapes: dict[str, tuple[int, ...]] | None = None) -> ParamSource:
        """Initial values of the model's own parameters, whole (global) tensors: the pretrained
        weights (`model.path`) where there are any, else the seeded init. `added`: parameters
        the assembly added to the model (adapters), which the files are never asked for (the
        assembly gives them values of their own). `shapes`: the global shapes of parameters
        the model holds a tensor-parallel shard of."""
        if self.weights is None:
            return self.seeded(model)
        self.resolve(model, skip=added, shapes=shapes)
        return self.weights

    def seeded(self, model: nn.Module) -> ParamSource:
        """The model's own initialization, each value a function of (seed, name) alone."""
        raise NotImplementedError

    def resolve(self, model: nn.Module, skip: frozenset[str] = frozenset(),
                shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """Match the pretrained weights' tensors to the model's parameters (but `skip`; of
        global shape `shapes[name]` where given): ModelError listing every mismatch. Other
        names of a parameter (a tied head) and persistent buffers may be in the files; they
        are not read."""
        if getattr(self, "_resolved", False):
            return
        params = global_shapes(model, skip, shapes)
        aliases = set(model.state_dict(keep_vars=True)) - set(params)
        self.weights.resolve(params, prefix=self._prefix(model), aliases=aliases, ignore=self._ignored(model))
        self._resolved = True

    def _prefix(self, model: nn.Module) -> str:
        return ""

    def _ignored(self, model: nn.Module) -> set[str]:
        """Tensors in the weights that are no parameter and may be passed over."""
        return {n for n, _ in model.named_buffers()}

    def fsdp_units(self, model: nn.Module) -> tuple[str, ...]:
        """ZeRO-3 unit classes when `sharding.fsdp_units` is left empty."""
        raise NotImplementedError

    @staticmethod
    def experts(model: nn.Module) -> frozenset[str]:
        """The parameters of a mixture of experts' experts (by `named_parameters` name): the
        strategy gives them a bucket group of their own, which expert parallelism reduces and
        shards over the ranks holding the same experts. Those inside a module named `experts`
        (transformers' MoE families keep each layer's routed experts there; a shared expert,
        which every token uses, and the router are dense)."""
        return frozenset(n for n, _ in model.named_parameters() if "experts" in n.split(".")[:-1])

    def blocks(self, model: nn.Module) -> tuple[str, ...]:
        """The classes of the model's repeated blocks (its transformer layers): what
        activation checkpointing recomputes when `model.recompute_blocks` is left empty."""
        raise NotImplementedError

    def stage_blocks(self, model: nn.Module) -> list[str]:
        """Pipeline stages are runs of these modules, by name, in forward order: the outermost
        modules of the `blocks` classes (the ones activation checkpointing recomputes)."""
        classes = set(self.blocks(model))
        found = outermost(model, classes)
        if not found:
            raise ModelError(f"parallel.pp: {type(model).__name__} has no blocks of class {', '.join(sorted(classes))} "
                             "to split into stages")
        return found

    def tp_plan(self, model: nn.Module) -> dict:
        """Tensor parallelism: module-name pattern -> `tensor_parallel.Style` for each linear
        that is split (the rest is replicated)."""
        raise ModelError(f"parallel.tp: model.kind={self.kind} has no tensor-parallel plan (the built-in GPT and "
                         "Hugging Face models whose config has a base_model_tp_plan, such as Llama, Qwen2 and "
                         "Mistral, have one); set parallel.tp=1")

    def sequence_ends(self, model: nn.Module) -> tuple[str, str]:
        """Sequence parallelism's region: (the first block, the final norm after the last)."""
        raise ModelError(f"parallel.sequence_parallel: model.kind={self.kind} does not say where its blocks begin "
                         "and end")

    def vocab_ends(self, model: nn.Module) -> tuple[str | None, str | None]:
        """(the input embedding, the output head) by module name, which tensor parallelism splits
        over the vocabulary; None for one the model does not have."""
        return None, None

    def parallelize(self, model: nn.Module, axis, sequence_parallel: bool = False, vocab_parallel: bool = True,
                    streams=None):
        """Split the model over the TP `axis` (`tensor_parallel.parallelize` with its plan),
        with sequence parallelism between `sequence_ends` and, with `vocab_parallel`, the
        embedding and head over the vocabulary; dropout drawn from `streams`. The `TPLayout`."""
        from rayzero.sharding.tensor_parallel import parallelize

        return parallelize(model, self.tp_plan(model), axis, self.sequence_ends(model) if sequence_parallel else None,
                           vocab=self.vocab_ends(model) if vocab_parallel else None, streams=streams)

    def expert_parallel(self, model: nn.Module, ep) -> dict[str, tuple[int, ...]]:
        """Keep this rank's E/ep experts of every MoE layer (`ep`: an `ExpertParallel`) and send
        the tokens to their experts' ranks: each split tensor's whole shape, by name (split along
        dim 0). A ModelError where the model has no experts the seam can split."""
        raise ModelError(f"parallel.ep: model.kind={self.kind} is dense: expert parallelism splits a mixture of "
                         "experts' experts (a Hugging Face MoE: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE); set parallel.ep=1")

    splits_sequence = False  # whether `context_parallel` can reach the model's attention

    def context_parallel(self, model: nn.Module, cp) -> None:
        """Make `model` run on a rank's part of each sequence (`cp`: a `ContextParallel`): its
        attention across the split (`cp.attend`), its positions the tokens' global ones
        (`cp.positions()`). A ModelError where the seam cannot reach the attention."""
        raise ModelError(f"parallel.cp: model.kind={self.kind} cannot run attention across a split sequence yet "
                         "(the built-in GPT can: model.kind=gpt)")

    @staticmethod
    def decays(name: str, param: torch.Tensor) -> bool:
        """Matrices decay; biases and norm gains do not (nanoGPT's and Megatron's rule)."""
        return param.dim() >= 2

    # -- training ------------------------------------------------------------------------
    def check_documents(self, model: nn.Module, why: str) -> None:
        """A ModelError where the model cannot keep packed rows' examples apart (`why` packs them)."""

    def logits(self, model: nn.Module, batch: MicroBatch):
        """The forward of `batch`, keeping packed rows' examples apart in the kind's own way."""
        if batch.packed:
            raise ModelError(f"{self.where}: model.kind={self.kind} says no way to keep packed examples apart")
        return model(batch.tokens)

    def positions(self, batch: MicroBatch) -> torch.Tensor:
        """Packed rows' tokens' positions in their examples (with cp, of this rank's tokens)."""
        t, device = batch.tokens.shape[1], batch.tokens.device
        index = self.cp.local_positions(t, device) if self.cp is not None else torch.arange(t, device=device)
        return batch.positions(index)

    def loss(self, model: nn.Module, batch: MicroBatch, check: bool = False, vocab=None):
        """(summed cross-entropy over valid targets, their count, the model's auxiliary loss or
        None) for one micro-batch; with `check`, the forward's output is checked to be
        [B, T, V] logits first. The auxiliary loss (a mixture of experts' router
        load-balancing loss, as the model computes it for this micro-batch) enters training
        scaled by `aux_coef`. `vocab`: this rank's `VocabShard` when the head is split over the
        vocabulary: the logits are its rows, and the loss is computed on the shards."""
        logits, out = self.forward(model, batch, check, vocab)
        return (*summed_nll(logits, batch.targets, vocab), self.aux_loss(out))

    def token_losses(self, model: nn.Module, batch: MicroBatch, check: bool = False, vocab=None,
                     temperature: float = 1.0):
        """(each target's cross-entropy [B, T] in fp32, 0 where the target is IGNORE_INDEX, of the
        logits over `temperature`; the model's auxiliary loss or None): what a loss over whole
        sequences (preference tuning) sums row by row. As `loss` otherwise."""
        logits, out = self.forward(model, batch, check, vocab)
        if temperature != 1.0:
            logits = logits / temperature
        return per_token_nll(logits, batch.targets, vocab), self.aux_loss(out)

    def forward(self, model: nn.Module, batch: MicroBatch, check: bool = False, vocab=None):
        """(the logits, the forward's whole output), checked with `check`."""
        if not check:
            out = self.logits(model, batch)
            return getattr(out, "logits", out), out
        x, y = batch.tokens, batch.targets
        try:
            out = self.logits(model, batch)
        except IndexError as e:  # an embedding lookup past the table
            raise ModelError(f"{self.where}: the forward failed on token ids up to {int(x.max())} "
                             f"(IndexError: {e}): is its vocabulary smaller than the data's?") from None
        logits = check_logits(out, x, self.where)
        vocab_size, top = vocab.size if vocab is not None else logits.shape[-1], int(max(x.max(), y.max()))
        if top >= vocab_size:
            raise ModelError(f"{self.where}: its vocabulary of {vocab_size} tokens is smaller than the data's: "
                             f"the batch holds token id {top}")
        return logits, out

    aux_coef = 0.0  # the weight of `aux_loss` in the training loss; 0: the model has none

    def aux_loss(self, out) -> torch.Tensor | None:
        """The model's auxiliary loss in the forward's output, or None."""
        return None

    def router_z_loss(self, model: nn.Module, coef: float) -> None:
        """`moe.router_z_loss`: the router z-loss joins the training loss with weight `coef`
        (a mixture of experts with a load-balancing loss); ModelError for a model without one."""
        if coef:
            raise ModelError(f"moe.router_z_loss: model.kind={self.kind} has no router load-balancing loss for the z-loss to "
                             "join (a Hugging Face mixture of experts whose config has router_aux_loss_coef > 0); "
                             "set moe.router_z_loss=0")

    def take_router_z(self) -> float | None:
        """The router z-loss of this rank's training forwards since the last call, summed over
        them (`moe.router_z_loss`); None without one."""
        return None

    def routers(self, model: nn.Module):
        """With an auxiliary loss that pipeline stages must compute together (a mixture of
        experts' router loss): what records its inputs stage by stage (`models/routers.py`);
        None for a model without one."""
        return None

    @property
    def where(self) -> str:
        """The config key that names this model, for messages."""
        return "model"

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def check(self, seq_len: int, data_vocab: int | None = None) -> None:
        """Raise a ModelError for what can be found before the cluster starts."""
        if data_vocab is not None and data_vocab > self.vocab_size:
            raise ModelError(f"{self.where}: its vocabulary of {self.vocab_size} tokens is smaller than the "
                             f"dataset's ({data_vocab})")

    # -- records and exports -----------------------------------------------------------
    def record(self) -> dict:
        """What a checkpoint notes of the model: its kind, source and a hash of its config."""
        raise NotImplementedError

    def adapter_record(self) -> dict:
        """The LoRA settings a model trains with, for its record (nothing without)."""
        return {"lora": self.cfg.lora.model_dump(mode="json")} if self.cfg.lora is not None else {}

    def export_plan(self, model: nn.Module) -> list[ExportEntry]:
        """Every tensor a safetensors export writes, by `state_dict()` name: a tied weight under
        each of its names (file formats refuse shared storage), persistent buffers as they are."""
        name_of = {id(p): n for n, p in model.named_parameters()}
        plan = []
        for key, v in model.state_dict(keep_vars=True).items():
            if id(v) in name_of:
                plan.append(ExportEntry(key, tuple(v.shape), param=name_of[id(v)]))
            else:
                plan.append(ExportEntry(key, tuple(v.shape), buffer=v.detach()))
        return plan

    def export_dtype(self, dtype: str = "auto") -> str:
        """The dtype an export writes floating tensors in: `auto` = the pretrained weights'
        (so that loading and exporting gives them back bit for bit), else float32."""
        if dtype != "auto":
            return dtype
        return self.weights.dtype() if self.weights is not None else "float32"

    def export_files(self, dtype: str) -> dict[str, bytes]:
        """The files an export in this model's own format writes beside the weights."""
        raise ModelError(f"model.kind={self.kind} exports safetensors only (an HF directory needs model.kind=hf)")

    def activation_shape(self, model: nn.Module):
        """The model's layer sizes for the activation estimate (`sharding.memory.ActivationShape`),
        or None where the model does not say (a user's module)."""
        return None

    def attention_shape(self, model: nn.Module) -> tuple[int, int] | None:
        """(attention layers, query width = heads x head size), for counting attention's FLOPs;
        None where the model does not say."""
        return None

    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        """Training FLOPs per token at `seq_len`: 6N for the forward and backward through every
        weight (N: all parameters, each tied one once) plus attention's 12·L·d·T (PaLM,
        appendix B), where the model's shape is known (else 6N alone)."""
        flops = 6.0 * self.num_params(model)[0]
        shape = self.attention_shape(model)
        if shape is not None:
            layers, width = shape
            flops += 12.0 * layers * width * seq_len
        return flops

    def num_params(self, model: nn.Module) -> tuple[int, int]:
        """(parameters, of which trainable), each tied weight counted once."""
        params = list(model.parameters())
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def outermost(model: nn.Module, classes) -> list[str]:
    """The names of the modules whose class is in `classes`, in module order, the outermost where
    they nest: a model's blocks."""
    found: list[str] = []
    for name, m in model.named_modules():
        if name and type(m).__name__ in classes and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _short_list(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f", … ({len(names)} in all)" if len(names) > n else "")
