"""A mixture of experts' router logits, gathered across pipeline stages for its load-balancing loss.

transformers computes the loss from every layer's router logits at once
(`load_balancing_loss_func` of the model's family: the experts' token shares and mean router
probabilities over all layers' tokens, multiplied), so no stage can compute its part alone.
Each stage records its routers' logits (the modules the model's `_can_record_outputs` names for
"router_logits") and passes them on with the activations, stacked after those it received; the
last stage calls the family's own function on all of them, so the loss, and the gradient that
flows back through the logits to every stage's routers, are transformers' at any pipeline size.

With context parallelism (or sequence parallelism, which splits the tokens over the TP ranks
around the MoE layers) a rank routes only its part of each sequence, and the loss is a function
of every token's routing: `balancing_loss` is the families' formula with the experts' token
counts and probability sums added over the axes the tokens are split over (`comm.summed`), so
that every rank of the group computes the loss of the whole sequences, and each rank's gradient
is its own tokens' part of it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn


def balancing_loss(gate_logits, experts: int, top_k: int, axes) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (Mixtral's, which Qwen2-MoE, Qwen3-MoE and OLMoE
    share; no attention mask) over the tokens of every rank of `axes` (the `Axis`es the tokens
    are split over): E x sum over experts of (the share of top-k assignments it gets) x (its mean
    router probability), each layer's tokens counted apart, the counts and sums added over the
    ranks."""
    from rayzero.sharding.comm import summed

    counts = torch.zeros(experts, dtype=torch.float32, device=gate_logits[0].device)
    probs = torch.zeros_like(counts)
    rows = 0
    for layer in gate_logits:
        weights = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts + torch.nn.functional.one_hot(chosen.reshape(-1), experts).sum(0).float()
        probs = probs + weights.float().sum(0)
        rows += weights.shape[0]
    counts = counts.detach()
    for axis in axes:
        counts, probs, rows = summed(counts, axis), summed(probs, axis), rows * axis.size
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * experts


def z_loss(gate_logits, axes) -> torch.Tensor:
    """ST-MoE's router z-loss over the tokens of every rank of `axes`: each layer's mean over
    tokens of logsumexp(logits)^2, summed over the layers."""
    from rayzero.sharding.comm import summed

    squares = sum(torch.logsumexp(layer.float(), dim=-1).square().sum() for layer in gate_logits)
    rows = gate_logits[0].shape[0]
    for axis in axes:
        squares, rows = summed(squares, axis), rows * axis.size
    return squares / rows


class _WithZ(torch.autograd.Function):
    """The load-balancing loss's value, with the z-loss's gradient (x `ratio`) added in backward:
    the training loss takes aux_coef x balance + z_coef x z, the reported router loss stays the
    balance (Megatron's `MoEAuxLossAutoScaler` attaches its router losses to a tensor alike)."""

    @staticmethod
    def forward(ctx, balance, z, ratio):
        ctx.ratio = ratio
        return balance.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad * ctx.ratio, None


@dataclass(frozen=True)
class Balance:
    """A mixture of experts' load-balancing loss over tokens split over ranks: over the tokens
    of every rank of `axes` (cp's, and tp's under sequence parallelism), `experts` and `top_k`
    the family's."""

    axes: tuple
    experts: int
    top_k: int
    z: float = 0.0  # the z-loss's weight over the load-balancing loss's (moe.router_z_loss / aux_coef)
    z_values: list = field(default_factory=list, compare=False)  # the step's z-losses, for its metrics

    def take_z(self) -> float | None:
        """The z-losses of the training forwards since the last call, summed (None without a z-loss)."""
        if not self.z:
            return None
        values, self.z_values[:] = list(self.z_values), []
        return float(torch.stack(values).sum()) if values else 0.0

    def of(self, out) -> torch.Tensor | None:
        """The loss of a forward's output (its `router_logits`, one tensor per layer)."""
        logits = getattr(out, "router_logits", None)
        return self.loss(logits) if logits else None

    def loss(self, gate_logits) -> torch.Tensor:
        """The load-balancing loss of every layer's logits, carrying the z-loss's gradient."""
        balance = balancing_loss(gate_logits, self.experts, self.top_k, self.axes)
        if not self.z:
            return balance
        z = z_loss(gate_logits, self.axes)
        if torch.is_grad_enabled() and torch._C._current_autograd_node() is None:  # training's forwards only
            self.z_values.append(z.detach().double())
        return _WithZ.apply(balance, z, self.z)


class RouterLogits:
    """Records the router logits of the modules that run while `recording` is a list."""

    def __init__(self, model: nn.Module, balance: Balance | None = None):
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        self.cls = getattr(recorder, "target_class", recorder)
        self.index = getattr(recorder, "index", 0)
        self.experts = int(getattr(model, "num_experts"))
        self.top_k = int(getattr(model, "num_experts_per_tok"))
        self._loss = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func")
        self.recording: list[torch.Tensor] | None = None
        self.balance = balance  # with the tokens split over ranks: the loss over all of them
        for m in model.modules():
            if isinstance(m, self.cls):
                m.register_forward_hook(self._record)
        # transformers records router logits (for the loss the last stage's forward computes, then
        # replaced by `loss`) through hooks it installs on the modules of the model's first forward;
        # installed now, while every block of this rank's stages is in place: a stage's forward
        # swaps the rank's other stages out, and the last stage's blocks would go unhooked
        from transformers.utils import output_capturing

        output_capturing.maybe_install_capturing_hooks(model)

    @staticmethod
    def of(model: nn.Module, balance: Balance | None = None) -> "RouterLogits | None":
        """The model's routers, when it records router logits and computes a loss from them
        (`balance`: with the tokens split over ranks, the loss over all of them)."""
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        family = sys.modules.get(type(model).__module__)
        if recorder is None or not hasattr(family, "load_balancing_loss_func") or not hasattr(model, "num_experts"):
            return None
        return RouterLogits(model, balance)

    def _record(self, _module, _args, output) -> None:
        if self.recording is not None:
            self.recording.append(output[self.index] if isinstance(output, (tuple, list)) else output)

    def count(self, module: nn.Module) -> int:
        """The routers inside `module` (a block)."""
        return sum(isinstance(m, self.cls) for m in module.modules())

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's load-balancing loss of every layer's logits, (layers, tokens, experts)."""
        if self.balance is not None:
            return self.balance.loss(tuple(logits.unbind(0)))
        return self._loss(tuple(logits.unbind(0)), self.experts, self.top_k, None)


class RouterLosses:
    """The model seam's router losses for a Hugging Face mixture of experts (a mixin of `HFSpec`,
    whose `aux_coef` it reads): transformers' own load-balancing loss, or `Balance` where the
    tokens are split over ranks (`_split_tokens`: cp, sequence parallelism) or a z-loss joins it
    (`router_z_loss`); one list of the step's z-losses however often the seam rebuilds it (a
    preference loss's reference model is built through it too)."""

    _token_axes: dict = {}  # role -> the `Axis` a rank's tokens are split over
    _z = 0.0  # moe.router_z_loss / aux_coef
    _balance: Balance | None = None

    def _split_tokens(self, model: nn.Module, role: str, axis) -> None:
        """A rank's tokens are split over `axis` (the `role`'s) too: the loss takes all of them."""
        self._token_axes = {**self._token_axes, role: axis}
        self._router_loss(model)

    def router_z_loss(self, model: nn.Module, coef: float) -> None:
        if coef and not self.aux_coef:
            super().router_z_loss(model, coef)  # the seam's refusal
        self._z = coef / self.aux_coef if coef else 0.0
        self._router_loss(model)

    def _router_loss(self, model: nn.Module) -> None:
        if self.aux_coef and (self._token_axes or self._z):
            self._balance = Balance(tuple(self._token_axes.values()), int(model.num_experts),
                                    int(model.num_experts_per_tok), self._z,
                                    self._balance.z_values if self._balance is not None else [])

    def aux_loss(self, out) -> torch.Tensor | None:
        if not self.aux_coef:
            return None
        if self._balance is not None:
            return self._balance.of(out)
        aux = getattr(out, "aux_loss", None)
        return aux if isinstance(aux, torch.Tensor) else None

    def take_router_z(self) -> float | None:
        return self._balance.take_z() if self._balance is not None else None

    def routers(self, model: nn.Module):
        return RouterLogits.of(model, self._balance) if self.aux_coef else None
