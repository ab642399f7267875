"""What differs between model kinds is asked of the spec (`rayzero.models`), never by testing
the kind elsewhere. Checked on the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import rayzero
from rayzero.models import spec_class

ROOT = Path(rayzero.__file__).resolve().parent
KINDS = {"gpt", "hf", "module"}


def names_kind(node: ast.AST) -> bool:
    """`kind`, `x.kind`, `x["kind"]`, `x.get("kind")` or `getattr(x, "kind")`."""
    if isinstance(node, ast.Name):
        return node.id == "kind"
    if isinstance(node, ast.Attribute):
        return node.attr == "kind"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    if isinstance(node, ast.Call):
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return called in ("get", "getattr") and any(isinstance(a, ast.Constant) and a.value == "kind"
                                                    for a in node.args)
    return False


def kind_tests(source: str) -> list[int]:
    """The lines that compare something named `kind` with a model kind's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
        if literals & KINDS and any(names_kind(n) for s in sides for n in ast.walk(s)):
            found.append(node.lineno)
    return found


def test_no_model_kind_is_tested_outside_models():
    files = [f for f in sorted(ROOT.rglob("*.py")) if ROOT / "models" not in f.parents]
    assert [f"{f.relative_to(ROOT.parent)}:{line}" for f in files for line in kind_tests(f.read_text())] == []


def test_the_check_sees_each_way_of_testing_the_kind():
    source = ('if cfg.model.kind == "hf": pass\n'
              'if m["model"].get("kind") != "module": pass\n'
              'if record["kind"] in ("gpt", "hf"): pass\n'
              'if getattr(spec, "kind", None) == "gpt": pass\n'
              'if kind == "module": pass\n'
              'if fmt == "hf" or failure.kind == ERROR: pass\n')
    assert kind_tests(source) == [1, 2, 3, 4, 5]


def test_each_kind_has_its_class():
    assert {kind: spec_class(kind).kind for kind in KINDS} == {kind: kind for kind in KINDS}
    assert spec_class(None).kind == "gpt"  # a record from before kinds were recorded


def test_the_configs_own_questions_of_the_kind_import_no_torch():
    """`train.save_format=hf` on a GPT is a config error, answered before torch is imported."""
    import subprocess
    import sys

    code = ("import sys; from rayzero.jobs.cli import main; rc = main(['train', 'train.save_format=hf']); "
            "print(rc, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["2", "False"]
    assert "train.save_format: hf needs model.kind=hf (this is model.kind=gpt)" in run.stderr
