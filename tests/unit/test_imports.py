"""The layers import in one direction only: jobs -> cluster -> workers -> sharding/models/data,
and every package that reads or writes a URI -> rayzero.storage, which imports no other layer.

Checked on the source with `ast`, so nothing here imports the modules (or ray).
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import rayzero

ROOT = Path(rayzero.__file__).resolve().parent  # .../rayzero


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (function bodies included), as absolute names.

    ``from a.b import c`` counts as importing both ``a.b`` and ``a.b.c`` (c may be a submodule).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    this = module_name(path)
    package = this if is_package(path) else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def files_under(subpackage: str) -> list[Path]:
    files = sorted((ROOT / subpackage).rglob("*.py"))
    assert files, f"no sources found under rayzero/{subpackage}"
    return files


def hits(name: str, forbidden: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


def violations(subpackage: str, forbidden: list[str]) -> list[str]:
    out = []
    for f in files_under(subpackage):
        for name in sorted(imports_of(f)):
            if any(hits(name, bad) for bad in forbidden):
                out.append(f"{f.relative_to(ROOT.parent)} imports {name}")
    return out


RULES = {
    "sharding": ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs"],
    "workers": ["rayzero.cluster", "rayzero.jobs"],
    "cluster": ["rayzero.jobs"],
    "models": ["ray", "rayzero.checkpoint"],  # storage is rayzero.storage, below both
    "data": ["ray", "rayzero.checkpoint"],
    "checkpoint": ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs"],
}


@pytest.mark.parametrize("subpackage", sorted(RULES))
def test_layer_does_not_import_upwards(subpackage):
    assert violations(subpackage, RULES[subpackage]) == []


def test_storage_is_below_every_layer():
    """The URI -> filesystem rule is one module that every package may import: it imports none."""
    assert sorted(n for n in imports_of(ROOT / "storage.py") if hits(n, "rayzero") or hits(n, "ray")) == []


# The pure layers must stay free of ray even through another rayzero module they import.

def source_of(module: str) -> Path | None:
    rel = Path(*module.split("."))
    for candidate in (ROOT.parent / rel / "__init__.py", (ROOT.parent / rel).with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def direct_deps(module: str) -> frozenset[str]:
    path = source_of(module)
    if path is None:
        return frozenset()
    deps = set(imports_of(path))
    # importing a.b.c runs a/__init__ and a/b/__init__ first
    for name in list(deps) + [module]:
        parts = name.split(".")
        deps.update(".".join(parts[:i]) for i in range(1, len(parts)))
    deps.discard(module)
    return frozenset(deps)


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if hits(m, "rayzero"):
            todo.extend(direct_deps(m))
    return seen


@pytest.mark.parametrize(
    "subpackage, forbidden",
    [
        ("sharding", ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs"]),
        ("models", ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs", "rayzero.checkpoint"]),
        ("data", ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs", "rayzero.checkpoint"]),
    ],
)
def test_pure_layers_do_not_reach_ray_transitively(subpackage, forbidden):
    bad = []
    for f in files_under(subpackage):
        for name in reachable(module_name(f)):
            if any(hits(name, b) for b in forbidden):
                bad.append(f"{module_name(f)} -> {name}")
    assert sorted(set(bad)) == []


# The checker itself must see real imports, or the rules above would pass vacuously.

def test_checker_sees_imports_including_relative_and_nested(tmp_path, monkeypatch):
    pkg = tmp_path / "rayzero" / "fake"
    pkg.mkdir(parents=True)
    (tmp_path / "rayzero" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(
        "import ray.util\n"
        "from . import sibling\n"
        "from ..cluster import controller\n"
        "def f():\n"
        "    from rayzero.jobs.train import run_train\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "rayzero")
    found = imports_of(pkg / "mod.py")
    assert "ray.util" in found
    assert "rayzero.fake.sibling" in found
    assert "rayzero.cluster.controller" in found
    assert "rayzero.jobs.train" in found
    assert not hits("rayzero", "ray")


def test_checker_finds_the_known_ray_imports_of_the_cluster_layer():
    assert violations("cluster", ["ray"]) != []
    assert violations("workers", ["ray"]) != []


# `rayzero --help` and a config error must answer at once: no torch, no Ray behind the CLI's
# module or the config (torch alone is a second of imports). Checked in a fresh interpreter.

@pytest.mark.parametrize("module", ["rayzero.jobs.cli", "rayzero.config", "rayzero"])
def test_cli_and_config_import_without_torch_or_ray(module):
    import subprocess

    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('torch', 'ray', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_config_error_imports_neither_torch_nor_ray():
    import subprocess

    code = ("import sys; from rayzero.jobs.cli import main; rc = main(['train', 'sharding.strategy=nope']); "
            "print(rc, 'torch' in sys.modules, 'ray' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["2", "False", "False"]
    assert "sharding.strategy" in run.stderr
