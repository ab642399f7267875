"""A rank's side of preference tuning (`train.objective=dpo`): the reference model's sequence
log-probabilities, and each micro-batch's loss over its pairs (`objectives/dpo.py`).

The reference, by what the run trains:
    full fine-tuning   a frozen copy of the starting weights, built by the same assembly and
                       sharded by the same strategy: compute dtype, no gradient, no main copy,
                       no optimizer state (`FrozenCopy`);
    LoRA               no copy: the policy itself with its adapters switched off, as TRL does
                       with PEFT (`AdaptersOff`);
    dpo.precompute_ref every pair's log-probabilities computed once, before training, by one of
                       the above, which is then dropped (`Precomputed`).
The reference runs forward only, in eval mode (no dropout: TRL's default), under no_grad.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from rayzero.objectives.dpo import PreferenceLoss, add_sums, counts, sequence_logps


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """`model` in eval mode, under no_grad, for the span; back in training mode after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


class FrozenCopy:
    """The starting weights, frozen, sharded like the policy (built by `assemble(frozen=True)`)."""

    def __init__(self, spec, model: nn.Module, strategy, vocab):
        self.spec, self.model, self.strategy, self.vocab = spec, model, strategy, vocab
        self.model.eval()

    def logps(self, x: torch.Tensor, y: torch.Tensor, pair_ids=None) -> torch.Tensor:
        with evaluating(self.model):
            per_token, _ = self.spec.token_losses(self.model, x, y, vocab=self.vocab)
        self.strategy.after_forward_only()  # ZeRO-3: nothing left gathered
        return sequence_logps(per_token)

    def memory(self) -> dict[str, int]:
        return {"reference_params": self.strategy.memory()["frozen_params"]}

    def identity(self) -> dict:
        return {"kind": "frozen_copy", "model": self.spec.record()}


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

    def logps(self, x: torch.Tensor, y: torch.Tensor, pair_ids=None) -> torch.Tensor:
        with self._off(), evaluating(self.model):
            per_token, _ = self.spec.token_losses(self.model, x, y, vocab=self.vocab)
        self.strategy.after_forward_only()
        return sequence_logps(per_token)

    def memory(self) -> dict[str, int]:
        return {"reference_params": 0}

    def identity(self) -> dict:
        return {"kind": "adapters_off", "model": self.spec.record()}


class PreferenceStep:
    """Each micro-batch's preference loss on this rank: the step's divisors (its pairs and
    chosen completion tokens over every rank, all-reduced once at the start of the step), the
    reference's log-probabilities, and the metrics' sums."""

    def __init__(self, cfg, spec, model, reference, mesh, device, vocab):
        self.cfg, self.spec, self.model, self.reference = cfg, spec, model, reference
        self.mesh, self.device, self.vocab = mesh, device, vocab
        self.loss = PreferenceLoss(cfg.dpo)
        self._divisors: tuple[float, float] | torch.Tensor = (1.0, 1.0)
        self._work = None
        self.sums: dict[str, float] = {}

    def begin(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A step starts: count its pairs (summed over the data-parallel ranks, waited for at the
        first forward) and clear the sums."""
        local = sum((counts(y) for _, y in micro), torch.zeros(2, dtype=torch.float64))
        self._divisors = local.to(self.device)
        self._work = self.mesh.axis("dp").start_all_reduce(self._divisors)
        self.sums = {}

    def divisors(self) -> tuple[float, float]:
        if self._work is not None:
            from rayzero.sharding.comm import wait

            wait(self._work)
            self._work = None
        if isinstance(self._divisors, torch.Tensor):
            self._divisors = tuple(float(v) for v in self._divisors.cpu())
        return self._divisors

    def forward(self, x: torch.Tensor, y: torch.Tensor, check: bool, pair_ids=None):
        """(this micro-batch's part of the step's loss, the model's auxiliary loss or None)."""
        ref = self.reference.logps(x, y, pair_ids) if self.reference is not None else None
        per_token, aux = self.spec.token_losses(self.model, x, y, check=check, vocab=self.vocab)
        loss, sums = self.loss(per_token, y, ref, self.divisors())
        add_sums(self.sums, sums)
        return loss, aux

    def evaluate(self, batches) -> dict[str, float]:
        """The metrics' sums over validation micro-batches (`batches`: (x, y, pair ids)),
        forward only; the loss summed per pair (the controller divides by the pairs)."""
        total: dict[str, float] = {}
        with evaluating(self.model):
            for x, y, ids in batches:
                ref = self.reference.logps(x, y, ids) if self.reference is not None else None
                per_token, _ = self.spec.token_losses(self.model, x, y, vocab=self.vocab)
                n = counts(y)
                loss, sums = self.loss(per_token, y, ref, (max(float(n[0]), 1.0), max(float(n[1]), 1.0)))
                add_sums(total, sums)
        return total


def start(cfg, spec, model, strategy, mesh, device, streams, vocab) -> PreferenceStep:
    """This rank's preference tuning: its reference (none for a reference-free loss) and loss."""
    reference = None
    if cfg.dpo.uses_reference:
        if cfg.model.lora is not None:
            reference = AdaptersOff(spec, model, strategy, vocab)
        else:
            from rayzero.workers.assembly import assemble

            ref_model, ref_strategy, _, _ = assemble(cfg, spec, mesh, device, streams, frozen=True)
            ref_vocab = ref_strategy.tp.vocab if ref_strategy.tp is not None else None
            reference = FrozenCopy(spec, ref_model, ref_strategy, ref_vocab)
    return PreferenceStep(cfg, spec, model, reference, mesh, device, vocab)
