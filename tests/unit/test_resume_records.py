"""A run resumes by running its command again, for every combination: the records a checkpoint
keeps of how it was made (the model's, its parameters' whole shapes and frozen names, the
objective's with its reference model) and what the same command computes of itself before it
starts (`resume_preview`) agree, for each configuration the suite's generator makes
(tests/combinations.py: strategy x tp x pp x model x recompute x LoRA/frozen x objective x
precision ...) and each kind of reference (a frozen copy, the base with the adapters off, none
for ORPO, a precomputed table).

No training: every rank's report of its model is its assembly's, on the meta device, as
`Rank.setup` gives it (`assembly.identity`: the steps before sharding, then its pipeline stage;
tests/dist/test_combinations.py holds each configuration's real ranks to the same report), and
the checkpoint is committed by `Checkpoints` as the controller commits one, its manifest through
JSON on disk. What is refused instead names the first field that differs, with both values.
The runs through the CLI's `main`: tests/e2e/test_dpo.py (each kind of reference)."""

from __future__ import annotations

import json

import pytest

from rayzero.checkpoint.records import first_difference, stored
from rayzero.cluster.checkpoints import Checkpoints
from rayzero.config import ConfigError, load_config
from rayzero.jobs.preflight import resume_preview
from rayzero.objectives.registry import objective_difference, objective_record
from rayzero.workers.assembly import make_spec
from tests import combinations as combos

STEP = combos.SAVE_AT


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return combos.save_models(tmp_path_factory.mktemp("models"))


def variants(c: dict) -> list[tuple[str, list[str]]]:
    """The configuration as generated, and for a preference objective also reference-free (ORPO)."""
    out = [(combos.label(c), [])]
    if c["objective"] == "dpo":
        out.append((combos.label(c) + ".orpo", ["dpo.loss=orpo"]))
    return out


CASES = [(c, extra) for c in combos.CONFIGS for _, extra in variants(c)]
IDS = [name for c in combos.CONFIGS for name, _ in variants(c)]


@pytest.mark.slow  # 0.2-0.6 s a configuration: an HF model built on meta runs its init functions there
@pytest.mark.parametrize("c,extra", CASES, ids=IDS)
def test_the_same_command_resumes_what_its_run_wrote(c, extra, dirs, tmp_path):
    keys = [*combos.overrides(c, combos.model_keys(c["model"], dirs)), *extra, f"checkpoint.dir={tmp_path / 'ck'}"]
    cfg = load_config(None, keys)  # the run's
    written = combos.commit_on_meta(cfg, [combos.rank_identity(cfg, r) for r in combos.stage_ranks(cfg)])
    manifest = json.loads((tmp_path / "ck" / f"step-{STEP:06d}" / "manifest.json").read_text())
    assert manifest["objective"]["name"] == ("dpo" if combos.pairs(c["objective"]) else
                                             {"own": "tests.own_objective:Weighted", "grpo": "grpo"}.get(c["objective"],
                                                                                                         "lm"))
    # the same command, run again: a config of its own, its own spec, the driver's build
    cfg = load_config(None, [*keys, f"train.steps={combos.STEPS + 2}"])
    found = resume_preview(Checkpoints(cfg), make_spec(cfg))
    assert found is not None and found.uri == written, "the run's own checkpoint is resumed"


def test_every_kind_of_reference_is_among_the_cases():
    kinds = set()
    for c, extra in CASES:
        cfg = load_config(None, [*combos.overrides(c, combos.model_keys(c["model"], {m: "." for m in combos.MODELS})),
                                 *extra])
        ref = objective_record(cfg, {"kind": "x"}).get("reference")
        kinds.add(("precomputed " if cfg.dpo.precompute_ref and ref else "") + (ref["kind"] if ref else
                  "none" if cfg.train.objective == "dpo" else "lm"))
    assert kinds >= {"lm", "none", "frozen_copy", "adapters_off", "precomputed frozen_copy"}, kinds


# -- the refusals ----------------------------------------------------------------------------------
LORA_DPO = ["model.kind=hf", "train.objective=dpo", "model.lora.r=4", "model.lora.alpha=8",
            "model.lora.target_modules=[q_proj,v_proj]"]


def test_records_compare_as_the_manifest_stores_them():
    record = {"lora": {"target_modules": ("q_proj",), "r": 4}, "kind": "hf"}
    assert stored(record) == {"lora": {"target_modules": ["q_proj"], "r": 4}, "kind": "hf"}
    assert first_difference(record, stored(record)) is None, "a tuple is its JSON list"
    assert first_difference({"a": {"b": 1, "c": [1]}}, {"a": {"b": 1, "c": [2]}}) == ("a.c", [1], [2])
    assert first_difference({"a": 1}, {"a": 1, "b": 2}) == ("b", "missing", 2)


def test_another_reference_is_refused_naming_the_first_field_and_the_ways_out():
    cfg = load_config(None, [*LORA_DPO, "model.path=base"])
    saved = json.loads(json.dumps(objective_record(cfg, {"kind": "hf", "source": "base", "config_sha256": "aa",
                                                         "lora": {"target_modules": ("q_proj",)}})))
    # the adapters' own settings are not the reference's: the base with them off is the same model
    assert objective_difference(saved, objective_record(cfg, {"kind": "hf", "source": "base", "config_sha256": "aa",
                                                              "lora": {"target_modules": ("v_proj",)}})) is None
    why = objective_difference(saved, objective_record(cfg, {"kind": "hf", "source": "base", "config_sha256": "bb"}))
    assert why.startswith("its reference model (adapters_off of base) is not this run's (adapters_off of base): "
                          "reference.model.config_sha256 is aa in the checkpoint, bb here; the rewards would be "
                          "measured against another model; train into another checkpoint.dir, or set "
                          "checkpoint.resume=none"), why
    orpo = load_config(None, [*LORA_DPO, "model.path=base", "dpo.loss=orpo"])
    why = objective_difference(saved, objective_record(orpo, {"kind": "hf", "source": "base"}))
    assert "(adapters_off of base) is not this run's (none)" in why and "checkpoint.resume=none" in why
    lm = load_config(None, ["model.kind=hf", "model.path=base"])
    why = objective_difference(saved, objective_record(lm, {"kind": "hf", "source": "base"}))
    assert why == ("it was trained with train.objective=dpo, this run has train.objective=lm; train into another "
                   "checkpoint.dir, or set checkpoint.resume=none to start from scratch beside them")


def test_a_checkpoint_of_another_reference_is_refused_before_anything_starts(dirs, tmp_path):
    keys = [*combos.model_keys("qwen2", dirs), "train.objective=dpo", "cluster.num_workers=2",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=32",
            f"checkpoint.dir={tmp_path / 'ck'}"]
    combos.commit_on_meta(load_config(None, keys), [combos.rank_identity(load_config(None, keys), 0)])
    cfg = load_config(None, [*keys, "dpo.loss=orpo"])
    with pytest.raises(ConfigError, match=r"cannot resume .*step-000002: its reference model \(frozen_copy of "
                                          r".*\) is not this run's \(none\)"):
        resume_preview(Checkpoints(cfg), make_spec(cfg))
