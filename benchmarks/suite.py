"""Where the test suite's time goes: per tier, per file and per capability, from one run's JUnit XML.

    .venv/bin/python -m pytest --junitxml=runs/suite.xml            # the full suite, as .ci/run runs it
    python benchmarks/suite.py runs/suite.xml [--before OLD.xml] [--top 10]

Reports, for the run (and side by side with `--before`, an earlier run's XML, as a ratio):
each tier's seconds (`tests/unit`, `tests/dist`, `tests/e2e`, `tests/gpu`) with its test count,
the `--top` most expensive files, and each capability's share of the whole (the files of a
capability are listed in `CAPABILITIES` below; a file not listed there is reported as such, so
that a new test file finds its capability). A test's time is pytest's: setup, call and teardown,
so a session fixture's cost falls on the first test that uses it.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict

# capability -> the test files that prove it (tests/<tier>/<name>.py, without the extension); a file
# merged away stays listed, so that an earlier run's XML (`--before`) counts it where it belonged
# (e2e/test_random_streams: its recompute run now rides e2e/test_failures)
CAPABILITIES = {
    "sharding and its equality (every axis, pairwise)": [
        "dist/test_combinations", "dist/test_matches_reference", "dist/test_models", "dist/test_fsdp_behaviour",
        "dist/test_collectives",
        "dist/test_instructions", "unit/test_allpairs", "unit/test_flat_buffer", "unit/test_layout",
        "unit/test_topology_units", "unit/test_precision", "unit/test_schedule", "unit/test_bucket_groups"],
    "memory formulas and caps": ["dist/test_memory", "dist/test_zero3_fits", "unit/test_strategy_table"],
    "models behind the seam (HF, conversions, MoE, modules)": [
        "dist/test_conversions", "dist/test_pretrained", "e2e/test_models", "unit/test_models", "unit/test_model_seam",
        "unit/test_conversions", "unit/test_adapters"],
    "activation checkpointing and random streams": [
        "dist/test_activation_checkpointing", "dist/test_random_streams", "e2e/test_random_streams",
        "unit/test_random_streams"],
    "LoRA": ["dist/test_lora"],
    "compiled blocks (torch.compile)": ["dist/test_compile"],
    "tensor parallelism": ["dist/test_tensor_parallel", "dist/test_vocab_parallel", "e2e/test_tensor_parallel"],
    "context parallelism": ["dist/test_context_parallel", "e2e/test_context_parallel", "unit/test_cp_split"],
    "expert parallelism": ["dist/test_expert_parallel", "e2e/test_expert_parallel"],
    "pipeline parallelism": [
        "dist/test_pipeline", "dist/test_pipeline_models", "dist/test_pipeline_checkpoints", "e2e/test_pipeline",
        "unit/test_pipeline_schedules", "unit/test_pipeline_stages"],
    "preference tuning (DPO)": [
        "dist/test_dpo", "e2e/test_dpo", "e2e/test_dpo_trl", "unit/test_dpo_losses", "unit/test_preferences",
        "unit/test_trl_reference"],
    "checkpoints and storage": [
        "dist/test_checkpoint_resume", "e2e/test_checkpoints", "e2e/test_storage", "unit/test_checkpoint_format",
        "unit/test_checkpoint_stages", "unit/test_storage", "unit/test_early_stopping"],
    "failures, spares and elasticity": [
        "dist/test_spares", "e2e/test_failures", "e2e/test_spares", "unit/test_failure_policy",
        "unit/test_controller_states"],
    "data": ["e2e/test_text_data", "unit/test_data", "unit/test_one_tokenizer", "unit/test_text_data"],
    "fine-tuning (packed examples alone, defaults, SFT equal to TRL)": [
        "unit/test_packed", "dist/test_packed", "e2e/test_sft_trl", "unit/test_defaults"],
    "tracking (MLflow)": ["e2e/test_mlflow_server", "unit/test_tracking"],
    "objectives and online RL (GRPO, rollouts)": [
        "e2e/test_objectives", "unit/test_objectives", "e2e/test_grpo", "e2e/test_grpo_trl", "unit/test_grpo_losses",
        "unit/test_rewards", "unit/test_rollout_engines"],
    "the CLI, SDK, jobs, the team path and the docs' examples": [
        "e2e/test_cli", "e2e/test_sdk", "e2e/test_job_submit", "e2e/test_team_path", "e2e/test_examples",
        "e2e/test_readme", "unit/test_docs", "e2e/test_cleanup",
        "e2e/test_bad_input", "unit/test_config", "unit/test_config_reference", "unit/test_dry_run",
        "unit/test_kuberay", "unit/test_dispatch", "unit/test_placement", "unit/test_imports", "unit/test_results",
        "unit/test_startup"],
    "GPU paths (skipped without CUDA)": ["gpu/test_cuda"],
}


def load(path: str) -> dict[str, float]:
    """tests/<tier>/<file> -> seconds, summed over its test cases."""
    files: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        if len(parts) >= 3 and parts[0] == "tests":
            files[f"{parts[1]}/{parts[2]}"] += float(case.get("time", 0))
    return dict(files)


def counts(path: str) -> dict[str, int]:
    tiers: dict[str, int] = defaultdict(int)
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        if len(parts) >= 3 and case.find("skipped") is None:
            tiers[parts[1]] += 1
    return dict(tiers)


def capability_of(name: str) -> str:
    for capability, names in CAPABILITIES.items():
        if name in names:
            return capability
    return "other unit tests" if name.startswith("unit/") else f"not listed ({name})"


def by(files: dict[str, float], key) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for name, seconds in files.items():
        out[key(name)] += seconds
    return dict(out)


def table(title: str, now: dict[str, float], before: dict[str, float] | None, rows: list[str],
          extra: dict[str, str] | None = None) -> list[str]:
    total = sum(now.values())
    head = f"| {title} | seconds | share |" + (" before | ratio |" if before is not None else "")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for row in rows:
        s = now.get(row, 0.0)
        if s < 0.5 and (before or {}).get(row, 0.0) < 0.5:
            continue  # nothing ran (a tier skipped here, say)
        line = f"| {row}{extra.get(row, '') if extra else ''} | {s:.0f} | {100 * s / total:.0f} % |"
        if before is not None:
            b = before.get(row, 0.0)
            line += f" {b:.0f} | {s / b:.2f} |" if b else " – | – |"
        lines.append(line)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml")
    ap.add_argument("--before", help="an earlier run's JUnit XML, reported beside this one")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    files = load(args.xml)
    before = load(args.before) if args.before else None
    tiers, n = by(files, lambda f: f.split("/")[0]), counts(args.xml)
    old_tiers = by(before, lambda f: f.split("/")[0]) if before is not None else None
    print(f"total: {sum(files.values()):.0f} s" + (f" (before: {sum(before.values()):.0f} s, ratio "
                                                  f"{sum(files.values()) / sum(before.values()):.2f})" if before else ""))
    print()
    print("\n".join(table("tier", tiers, old_tiers, sorted(tiers, key=tiers.get, reverse=True),
                          {t: f" ({n.get(t, 0)} tests)" for t in tiers})))
    print()
    top = sorted(files, key=files.get, reverse=True)[:args.top]
    print("\n".join(table("file", files, before, top)))
    print()
    caps = by(files, capability_of)
    old_caps = by(before, capability_of) if before is not None else None
    print("\n".join(table("capability", caps, old_caps, sorted(caps, key=caps.get, reverse=True))))


if __name__ == "__main__":
    main()
