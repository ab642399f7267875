"""The reference model an objective compares the policy with (its `reference`), built by the rank:

    none           no reference (next-token, ORPO)
    frozen_copy    the starting weights, frozen, built by the same assembly and sharded by the
                   same strategy: compute dtype, no gradient, no main copy, no optimizer state
    adapters_off   no copy: the policy itself with its LoRA adapters switched off, as TRL does
                   with PEFT (what a LoRA run's reference is)

A reference runs forward only, in eval mode (no dropout), under no_grad, and gives the objective
what `reduce` makes of its per-token cross-entropy ([rows, T], 0 where the target is
IGNORE_INDEX): a micro-batch at a time (`values`), or through the pipeline's stages on the last
one (`stage_values`). An objective that precomputes its reference's values (`precomputed`) asks
for one of the two above, uses it before training, and drops it.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn

from rayzero.objectives.base import evaluating


class FrozenCopy:
    """The starting weights, frozen, sharded like the policy (built by `assemble(frozen=True)`),
    split into the same pipeline stages (`stages`) when the policy is."""

    def __init__(self, spec, model: nn.Module, strategy, vocab, stages=None):
        self.spec, self.model, self.strategy, self.vocab = spec, model, strategy, vocab
        self.model.eval()
        self.runner = None
        if stages is not None:
            from rayzero.pipeline.stages import StageRunner

            self.runner = StageRunner(model, stages)

    def values(self, batch, reduce, temperature: float = 1.0):
        with evaluating(self.model):
            per_token, _ = self.spec.token_losses(self.model, batch, vocab=self.vocab, temperature=temperature)
        self.strategy.after_forward_only()  # ZeRO-3: nothing left gathered
        return reduce(per_token)

    def stage_values(self, pipe, micro, reduce, temperature: float = 1.0) -> list:
        """Through the pipeline, forward only: each micro-batch's on the last stage."""
        with evaluating(self.model):
            out = pipe.forward_only(micro, _last(self.spec, self.vocab, reduce, temperature), self.runner)
        self.strategy.after_forward_only()
        return out

    def memory(self) -> dict[str, int]:
        return {"reference_params": self.strategy.memory()["frozen_params"]}


class AdaptersOff:
    """The policy with its LoRA adapters switched off: the base model, which LoRA never trains."""

    def __init__(self, spec, model: nn.Module, strategy, vocab):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.spec, self.model, self.strategy, self.vocab = spec, model, strategy, vocab
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    @contextlib.contextmanager
    def _off(self):
        for m in self.layers:
            m._disable_adapters = True  # not `enable_adapters(False)`, which would change requires_grad
        try:
            yield
        finally:
            for m in self.layers:
                m._disable_adapters = False

    def values(self, batch, reduce, temperature: float = 1.0):
        with self._off(), evaluating(self.model):
            per_token, _ = self.spec.token_losses(self.model, batch, vocab=self.vocab, temperature=temperature)
        self.strategy.after_forward_only()
        return reduce(per_token)

    def stage_values(self, pipe, micro, reduce, temperature: float = 1.0) -> list:
        with self._off(), evaluating(self.model):
            out = pipe.forward_only(micro, _last(self.spec, self.vocab, reduce, temperature))
        self.strategy.after_forward_only()
        return out

    def memory(self) -> dict[str, int]:
        return {"reference_params": 0}


def _last(spec, vocab, reduce, temperature: float = 1.0):
    """The last stage's part of a forward-only pass: `reduce` of the per-token cross-entropy
    (of the logits over `temperature`)."""
    return lambda m, b: reduce(spec.token_losses(m, b, vocab=vocab, temperature=temperature)[0])


def build_reference(kind: str, cfg, spec, model, strategy, mesh, device, streams, vocab):
    """The reference of `kind` (`Objective.reference_model`), or None for `none`."""
    if kind == "none":
        return None
    if kind == "adapters_off":
        return AdaptersOff(spec, model, strategy, vocab)
    if kind == "frozen_copy":
        from rayzero.workers.assembly import assemble

        ref_model, ref_strategy, _, ref_stages = assemble(cfg, spec, mesh, device, streams, frozen=True)
        ref_vocab = ref_strategy.tp.vocab if ref_strategy.tp is not None else None
        return FrozenCopy(spec, ref_model, ref_strategy, ref_vocab, ref_stages)
    raise ValueError(f"an objective's reference model: unknown kind {kind!r} (none, frozen_copy, adapters_off)")
