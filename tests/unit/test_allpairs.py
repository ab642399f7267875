"""The all-pairs generator (`tests/allpairs.py`) and the configurations it makes for the
sharded-training equality tests (`tests/combinations.py`): every pair of values the rules allow
meets in some configuration, no configuration breaks a rule, the named triples are there, the
same configurations come out every time, and every pair left out is one the product refuses."""

from itertools import combinations, product
from pathlib import Path

import pytest

from tests import combinations as combos
from tests.allpairs import Rules, all_pairs, infeasible_pairs, pairs_of


def covered(cases, names) -> set:
    return set().union(*(pairs_of(c, names) for c in cases))


def test_every_pair_of_a_small_product_is_covered_by_few_cases():
    axes = {name: [0, 1, 2] for name in "abcd"}
    cases = all_pairs(axes, lambda c: True)
    want = {(a, x, b, y) for a, b in combinations("abcd", 2) for x, y in product(range(3), repeat=2)}
    assert covered(cases, list(axes)) == want
    assert len(cases) <= 11 < 3 ** 4, "9 is the least; the full product is 81"


def test_a_rule_leaves_out_its_pairs_and_only_those():
    rules = Rules()
    rules.rule("no a=0 with b=1", ["a", "b"], lambda a, b: not (a == 0 and b == 1))
    rules.rule("c=2 needs d=2", ["c", "d"], lambda c, d: c != 2 or d == 2)
    axes = {name: [0, 1, 2] for name in "abcd"}
    cases = all_pairs(axes, rules)
    assert all(rules(c) for c in cases)
    assert sorted(infeasible_pairs(axes, rules)) == [("a", 0, "b", 1), ("c", 2, "d", 0), ("c", 2, "d", 1)]
    assert covered(cases, list(axes)) == {(a, x, b, y) for a, b in combinations("abcd", 2)
                                          for x, y in product(range(3), repeat=2)} - set(infeasible_pairs(axes, rules))
    assert rules.broken({"a": 0, "b": 1, "c": 0}) == ["no a=0 with b=1"]


def test_required_configurations_come_first_completed_and_a_bad_one_is_refused():
    axes = {name: [0, 1] for name in "abc"}
    rules = Rules()
    rules.rule("a needs c", ["a", "c"], lambda a, c: a <= c)
    cases = all_pairs(axes, rules, required=[{"a": 1}])
    assert cases[0]["a"] == 1 and cases[0]["c"] == 1
    with pytest.raises(ValueError, match="no valid completion"):
        all_pairs(axes, rules, required=[{"a": 1, "c": 0}])


def test_the_generated_configurations_cover_every_allowed_pair():
    names = list(combos.AXES)
    excluded = set(combos.excluded_pairs())
    every = {(a, x, b, y) for a, b in combinations(names, 2) for x in combos.AXES[a] for y in combos.AXES[b]}
    assert covered(combos.CONFIGS, names) == every - excluded
    assert [combos.RULES.broken(c) for c in combos.CONFIGS if combos.RULES.broken(c)] == []
    assert all(set(c) == set(names) for c in combos.CONFIGS)


def test_the_named_triples_run_and_the_configurations_are_the_same_every_time():
    for named in combos.COMPILED + combos.NAMED:
        assert any(all(c[k] == v for k, v in named.items()) for c in combos.CONFIGS), named
    again = all_pairs(combos.AXES, combos.RULES, combos.COMPILED + combos.NAMED, cost=combos.cost)
    assert again == combos.CONFIGS
    assert [c for c in combos.CONFIGS if c["compile"] != "off"] == combos.COMPILED, "the fill compiles no block"
    labels = [combos.label(c) for c in combos.CONFIGS]
    assert len(set(labels)) == len(labels), "each configuration's test id says what it is"
    assert all(2 <= combos.world(c) <= 4 for c in combos.CONFIGS)


# Each rule that leaves pairs out mirrors a refusal of the product's own checks (the config's, or the
# driver's before a cluster starts): were the product to accept one, the generator would be
# hiding a combination users can run.
REFUSED = [
    ("a strategy shards over data-parallel x cp ranks", None, None),  # not refused: sharding over 1 rank is no test
    ("hybrid sharding's replicas are data-parallel ranks", ["parallel.cp=2", "sharding.dp_outer=2"],
     "does not divide cluster.num_workers (2)"),
    ("ulysses splits a tensor-parallel rank's key/value heads",
     ["parallel.cp=2", "parallel.cp_mode=ulysses", "model.n_head=3", "model.n_embd=96"], "ulysses splits the attention heads"),
    ("ulysses splits a tensor-parallel rank's key/value heads",
     ["cluster.num_workers=4", "parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.tp=2", "model.n_head=2",
      "model.n_embd=64"], "a tensor-parallel rank's 1 heads / 1 key/value heads do not divide"),
    ("expert parallelism splits a mixture of experts' experts", ["parallel.ep=2", "cluster.num_workers=2"],
     "model.kind=gpt is dense"),
    ("expert parallelism folds into the data-parallel ranks",
     ["hf:mixtral", "cluster.num_workers=2", "parallel.ep=2", "parallel.tp=2"],
     "parallel.ep x parallel.tp: 2 x 2 = 4 does not divide cluster.num_workers (2)"),
    ("hybrid sharding's replicas and expert parallelism share the data-parallel ranks",
     ["hf:mixtral", "cluster.num_workers=2", "parallel.ep=2", "sharding.dp_outer=2",
      "sharding.strategy=optim_grads_params"], "does not divide cluster.num_workers (2)"),
    ("at most 4 ranks, at least 2", None, None),  # the test machine's size, not the product's
    ("whole micro-batches", ["cluster.num_workers=2", "train.global_batch_size=8", "train.micro_batch_size=3"],
     "global_batch_size"),
    ("tensor parallelism needs a plan", ["model.kind=module", "model.factory=tests.models:TinyLM", "parallel.tp=2"],
     "no tensor-parallel plan"),
    ("tensor parallelism needs a plan", ["hf:gpt2", "parallel.tp=2"], "no tensor-parallel plan"),
    ("sequence parallelism needs a final norm", ["hf:phi", "parallel.tp=2", "parallel.sequence_parallel=true"],
     "no final `norm`"),
    ("a pipeline needs blocks to cut", ["model.kind=module", "model.factory=tests.models:TinyLM", "parallel.pp=2"],
     "does not say how it splits into stages"),
    ("the schedule's micro-batch count", ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=4",
                                          "train.micro_batch_size=4"], "micro-batches"),
    ("zero-bubble's weight gradients need the units ZeRO-3 released",
     ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "sharding.strategy=optim_grads_params", "model.n_layer=2"],
     "after ZeRO-3 has released the units"),
    ("zero-bubble's second backward through a block",
     ["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "model.activation_checkpointing=selective", "model.n_layer=2"],
     "selective activation checkpointing allows one"),
    ("a compiled block runs as one op to selective recomputation",
     ["train.compile=true", "model.activation_checkpointing=selective"], "use full or every:N with compile"),
    ("a preference pair in one micro-batch", ["train.objective=dpo", "train.micro_batch_size=1",
                                              "train.global_batch_size=8"], "would split a preference pair"),
]


def test_every_rule_is_listed_with_the_refusal_it_mirrors():
    assert sorted({name for name, _, _ in REFUSED}) == sorted(name for name, _, _ in combos.RULES.rules)


@pytest.mark.parametrize("rule, keys, says", [r for r in REFUSED if r[1] is not None], ids=lambda x: str(x)[:40])
def test_a_pair_left_out_is_one_the_product_refuses(rule, keys, says, tmp_path):
    from rayzero.config import ConfigError, load_config
    from rayzero.jobs.train import check_model
    from tests.models import save_hf_model

    resolved = []
    for k in keys:  # hf:ARCH, a tiny model of that architecture
        resolved += ["model.kind=hf", f"model.path={save_hf_model(k[3:], tmp_path / k[3:])}"] if k.startswith("hf:") else [k]
    with pytest.raises((ConfigError, ValueError)) as refused:
        check_model(load_config(None, ["cluster.num_workers=2", "train.seq_len=32", "train.global_batch_size=8",
                                       "train.micro_batch_size=2", *resolved]))
    assert says in str(refused.value), str(refused.value)


def test_the_docs_say_what_the_configurations_cover():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "concepts" / "tests.md").read_text()
    start, end = "<!-- configurations: python -m tests.combinations -->\n", "\n<!-- /configurations -->"
    assert start in readme and end in readme
    said = readme[readme.index(start) + len(start):readme.index(end)]
    assert said == combos.readme_block(), "docs/concepts/tests.md: paste `python -m tests.combinations`"
