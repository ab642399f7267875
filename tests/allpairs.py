"""All-pairs ("pairwise") test configurations: every pair of values of any two axes meets in at
least one configuration, for a small fraction of the full product.

    cases = all_pairs({"a": [1, 2], "b": ["x", "y"], "c": [True, False]}, valid)

`valid(partial)` says whether a partial assignment (a dict over some of the axes) breaks a rule
among the axes it assigns; it is called on partial assignments, so each rule must decide only
from the axes present (`Rules` below makes that easy). A pair that no valid configuration holds
is infeasible and left out: `infeasible_pairs` lists them, for a test to show what is excluded.

`required` configurations (partial: the named triples where an interaction is known) come
first, each completed to a valid configuration that covers as many new pairs as it can; then
the greedy fill (AETG's: one configuration at a time, each axis given the value that covers
the most pairs not yet covered, ties to the earlier value) runs until every feasible pair is
covered. Deterministic: the same axes and rules give the same configurations in the same order.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations
from typing import Callable, Hashable, Iterable

Config = dict[str, Hashable]
Pair = tuple[str, Hashable, str, Hashable]


class Rules:
    """Named rules over axes: `rule(name, axes, test)` holds unless every axis in `axes` is
    assigned and `test(**values)` is false. `__call__` is the `valid` that `all_pairs` takes;
    `broken(config)` names the rules a configuration breaks."""

    def __init__(self):
        self.rules: list[tuple[str, tuple[str, ...], Callable[..., bool]]] = []

    def rule(self, name: str, axes: Iterable[str], test: Callable[..., bool]) -> None:
        self.rules.append((name, tuple(axes), test))

    def broken(self, config: Config) -> list[str]:
        return [name for name, axes, test in self.rules
                if all(a in config for a in axes) and not test(**{a: config[a] for a in axes})]

    def __call__(self, config: Config) -> bool:
        return not self.broken(config)


def pairs_of(config: Config, names: list[str]) -> set[Pair]:
    return {(a, config[a], b, config[b]) for a, b in combinations([n for n in names if n in config], 2)}


def all_pairs(axes: dict[str, list], valid: Callable[[Config], bool], required: Iterable[Config] = (),
              cost: Callable[[Config], float] = lambda c: 1.0, candidates: int = 16) -> list[Config]:
    """Valid configurations (dicts over every axis) covering every feasible pair of values.

    `cost(config)`: what running one costs (say, its ranks), also asked of partial configurations
    (it should then count what is missing at its cheapest); each new configuration is the best,
    in new pairs covered per cost, of the completions of the first `candidates` pairs not yet
    covered. Configurations left redundant (every pair they cover covered by the others) are
    dropped at the end, the required ones never."""
    names = list(axes)
    order = {(a, v): i for a in names for i, v in enumerate(axes[a])}
    completes = _completer(axes, valid)
    uncovered = {(a, va, b, vb) for a, b in combinations(names, 2) for va in axes[a] for vb in axes[b]
                 if completes(_key({a: va, b: vb}))}
    rank = {p: (names.index(p[0]), order[p[0], p[1]], names.index(p[2]), order[p[2], p[3]]) for p in uncovered}
    cases: list[Config] = []
    for partial in required:
        if not completes(_key(partial)):
            raise ValueError(f"required configuration {partial} has no valid completion")
        cases.append(_fill(dict(partial), axes, names, uncovered, completes, cost))
        uncovered -= pairs_of(cases[-1], names)
    fixed = len(cases)
    while uncovered:
        seeds = sorted(uncovered, key=rank.__getitem__)[:candidates]
        tried = [_fill({a: va, b: vb}, axes, names, uncovered, completes, cost) for a, va, b, vb in seeds]
        best = max(tried, key=lambda c: len(pairs_of(c, names) & uncovered) / cost(c))  # first of the best
        cases.append(best)
        uncovered -= pairs_of(best, names)
    for i in range(len(cases) - 1, fixed - 1, -1):  # the last added first: they cover the fewest
        others = set().union(*(pairs_of(c, names) for j, c in enumerate(cases) if j != i))
        if pairs_of(cases[i], names) <= others:
            del cases[i]
    return cases


def infeasible_pairs(axes: dict[str, list], valid: Callable[[Config], bool]) -> list[Pair]:
    """The pairs of values that no valid configuration holds."""
    completes = _completer(axes, valid)
    return [(a, va, b, vb) for a, b in combinations(list(axes), 2) for va in axes[a] for vb in axes[b]
            if not completes(_key({a: va, b: vb}))]


def _fill(case: Config, axes: dict[str, list], names: list[str], uncovered: set[Pair], completes,
          cost: Callable[[Config], float]) -> Config:
    """`case` completed axis by axis, each given the value that covers the most uncovered pairs
    with the values so far (ties: the cheaper partial configuration, then the earlier value)."""
    for axis in names:
        if axis in case:
            continue
        best, best_score = None, None
        for v in axes[axis]:
            trial = {**case, axis: v}
            if not completes(_key(trial)):
                continue
            gain = sum((axis, v, b, case[b]) in uncovered or (b, case[b], axis, v) in uncovered for b in case)
            score = (gain, -cost(trial))
            if best_score is None or score > best_score:
                best, best_score = v, score
        case[axis] = best
    return case


def _key(partial: Config) -> tuple:
    return tuple(sorted(partial.items(), key=lambda kv: kv[0]))


def _completer(axes: dict[str, list], valid: Callable[[Config], bool]):
    names = list(axes)

    @lru_cache(maxsize=None)
    def completes(key: tuple) -> bool:
        """Whether the partial assignment extends to a valid configuration over every axis."""
        partial = dict(key)
        if not valid(partial):
            return False
        rest = [a for a in names if a not in partial]
        if not rest:
            return True
        axis = rest[0]
        return any(completes(_key({**partial, axis: v})) for v in axes[axis])

    return completes
