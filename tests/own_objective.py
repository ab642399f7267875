"""A user's own objective as the generated configurations train it (`objective=own` in
tests/combinations.py): every part of the interface a loss of one's own uses, on every axis.

Each valid target's cross-entropy weighted by a token field that `prepare` adds on whole rows (2
where the target id is even, 1 where it is odd, 0 where it is masked), divided by the step's summed
weight (its own `count`), with the plain cross-entropy (a mean over that count) and the largest
weighted cross-entropy of any token (a max) as its metrics."""

from __future__ import annotations

from rayzero.objectives import Metric, Objective


class Weighted(Objective):
    metrics = (Metric("nll", "mean"), Metric("max_weighted", "max"))

    def prepare(self, batch):
        weight = (1.0 + (batch.targets % 2 == 0).float()) * batch.loss_mask
        return batch.with_fields(tokens={"weight": weight})

    def count(self, batch):
        return batch.token_fields["weight"].sum()

    def loss(self, out, batch):
        w, nll = batch.token_fields["weight"], -out.token_logps
        return (w * nll).sum(), {"nll": nll.sum().detach(), "max_weighted": (w * nll).max().detach()}
