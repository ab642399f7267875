"""The layers import in one direction only: jobs -> cluster -> workers -> sharding/models/data,
and no modules import each other round a cycle (function-level imports count); every package that
reads or writes a URI -> rayzero.storage, which imports no other layer.

Checked on the source with `ast`, so nothing here imports the modules (or ray).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from fnmatch import fnmatchcase
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


def imports_of(path: Path, tree: ast.Module | None = None, annotations: bool = False) -> set[str]:
    """Every module a file imports, anywhere in it (function bodies included), as absolute names.

    ``from a.b import c`` counts as importing both ``a.b`` and ``a.b.c`` (c may be a submodule).
    What is imported only for annotations (under ``if TYPE_CHECKING:``) never runs, and is not
    counted (`annotations=True`: counted too): a policy may name the `Strategy` it serves.
    """
    tree = tree or ast.parse(path.read_text(), filename=str(path))
    this = module_name(path)
    package = this if is_package(path) else this.rpartition(".")[0]
    found: set[str] = set()
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only and not annotations:
            continue
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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


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
    "pipeline": ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs", "rayzero.models", "rayzero.checkpoint"],
    "workers": ["rayzero.cluster", "rayzero.jobs"],
    "cluster": ["rayzero.jobs"],
    "models": ["ray", "rayzero.checkpoint"],  # storage is rayzero.storage, below both
    "data": ["ray", "rayzero.checkpoint"],
    "checkpoint": ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs"],
    "objectives": ["ray", "rayzero.cluster", "rayzero.workers", "rayzero.jobs", "rayzero.pipeline"],
}


@pytest.mark.parametrize("subpackage", sorted(RULES))
def test_layer_does_not_import_upwards(subpackage):
    assert violations(subpackage, RULES[subpackage]) == []


def test_storage_is_below_every_layer():
    """The URI -> filesystem rule is one module that every package may import: it imports none."""
    assert sorted(n for n in imports_of(ROOT / "storage.py") if hits(n, "rayzero") or hits(n, "ray")) == []


def test_trl_is_only_the_tests_reference():
    """trl is a dev dependency, what the preference-data tests compare with: rayzero never imports it."""
    assert sorted(module_name(f) for f in ROOT.rglob("*.py") if any(hits(n, "trl") for n in imports_of(f))) == []


# What a rank process imports as it starts (Ray starts one per rank, at every placement and
# restart): what only some runs use is imported where it is used. torch.distributed.pipelining
# alone (it brings torch._dynamo and DTensor's ops) cost each rank ~3 s of CPU at start.

RANK_START_FORBIDDEN = ["torch.distributed.pipelining", "torch._dynamo", "transformers", "peft", "trl", "mlflow",
                        "matplotlib", "pandas"]


def module_level_imports_of(path: Path) -> set[str]:
    """The imports a module runs when it is imported: `imports_of` without those in function bodies."""
    class WithoutBodies(ast.NodeTransformer):
        def visit_FunctionDef(self, node):
            return None

        visit_AsyncFunctionDef = visit_FunctionDef

    tree = WithoutBodies().visit(ast.parse(path.read_text(), filename=str(path)))
    return imports_of(path, tree)


def imported_at_start(start: str) -> set[str]:
    """Every module importing `start` runs, following rayzero's own modules' module-level imports."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        path = source_of(m)
        if hits(m, "rayzero") and path is not None:
            parts = m.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
            todo.extend(module_level_imports_of(path))
    return seen


# What a rank's actor imports as its process starts (`RankShim.__init__`), besides its module.
RANK_START = ("rayzero.workers.actor", "rayzero.workers.membership", "rayzero.workers.rank")


def test_a_rank_process_starts_without_what_only_some_runs_use():
    started = set().union(*(imported_at_start(m) for m in RANK_START))
    assert "rayzero.workers.assembly" in started and "torch" in started  # the walk follows real imports
    assert sorted(n for n in started if any(hits(n, bad) for bad in RANK_START_FORBIDDEN)) == []


def test_the_driver_names_the_rank_actor_without_torch():
    """The CLI places its ranks ahead of its own imports (`place_ahead`): the actor's module
    imports neither torch nor the rank's code; its process imports them as it starts."""
    started = imported_at_start("rayzero.workers.actor")
    assert not [n for n in started if hits(n, "torch") or hits(n, "rayzero.workers.rank")]
    init = inspect.getsource(importlib.import_module("rayzero.workers.actor").RankShim.__init__)
    assert all(f"from {m} import" in init for m in RANK_START[1:])


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


# No import cycles, and no import upwards. Every module has a layer; it imports from its own
# layer and those below it only. A component's config module is a leaf that the root config
# composes (config lives with its component), so it sits in the bottom layer whatever package
# holds it; the root config sits above the components it composes, below the code that runs
# them. An entry names a module or a package (with its modules); `*` matches any name.

LAYERS = [
    # URI -> filesystem (rayzero.storage): the data, the models and the checkpoints read through it,
    # and the checkpoint config makes its settings; the records a checkpoint keeps, as a resume
    # compares them (the objective's config writes its own)
    ["rayzero._frozen", "rayzero._imports", "rayzero.version", "rayzero.storage", "rayzero.*.config", "rayzero.checkpoint.records",
     "rayzero.step_report"],  # a step's report: the ranks write it, the driver merges it
    ["rayzero.sharding", "rayzero.pipeline"],
    ["rayzero.data"],
    ["rayzero.models"],
    ["rayzero.objectives", "rayzero.rollout"],  # a loss reads the model seam's output and the data's batches;
    # an engine samples from a policy
    ["rayzero.checkpoint"],
    ["rayzero.config"],
    ["rayzero.workers"],
    ["rayzero.cluster"],
    ["rayzero.jobs"],
    ["rayzero.sdk", "rayzero.config_reference", "rayzero.cli_reference"],
]
TOP = len(LAYERS)  # the package root, which re-exports the SDK: nothing imports it


def layer_of(module: str) -> int | None:
    """The layer of the most specific entry (the one with the most dotted parts) naming `module`."""
    if module == "rayzero":
        return TOP
    found = [(entry.count("."), i) for i, layer in enumerate(LAYERS) for entry in layer
             if fnmatchcase(module, entry) or fnmatchcase(module, entry + ".*")]
    return max(found)[1] if found else None


def module_graph() -> dict[str, set[str]]:
    """Each rayzero module -> the rayzero modules it imports, function bodies included."""
    return _graph(ROOT)


@lru_cache(maxsize=None)
def _graph(root: Path, annotations: bool = False) -> dict[str, set[str]]:
    files = {module_name(f): f for f in sorted(root.rglob("*.py"))}
    return {m: {n for n in imports_of(f, annotations=annotations) if n in files and n != m} for m, f in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm), as the
    modules in import order, the first one again at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the first of its group left on the stack: pop the group
            group = set()
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, group) for group in groups]


def _cycle_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest import path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(f"no cycle in {sorted(group)}")


def test_no_import_cycles():
    assert [" -> ".join(c) for c in cycles(module_graph())] == []


def test_no_import_cycles_even_through_annotations():
    """Not even one an annotation closes (`if TYPE_CHECKING:`): a runner is handed what it needs
    (`StepContext`), never the rank that made it."""
    assert [" -> ".join(c) for c in cycles(_graph(ROOT, annotations=True))] == []


def test_every_module_has_a_layer():
    assert [m for m in sorted(module_graph()) if layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} (layer {layer_of(m)}) imports {n} (layer {layer_of(n)})"
           for m, deps in sorted(module_graph().items()) for n in sorted(deps)
           if None not in (layer_of(m), layer_of(n)) and layer_of(n) > layer_of(m)]
    assert bad == []


def test_layers_place_what_they_should():
    assert layer_of("rayzero.cluster.config") == 0 and layer_of("rayzero.models.config") == 0
    assert layer_of("rayzero.storage") == 0 < layer_of("rayzero.data") < layer_of("rayzero.checkpoint")
    assert layer_of("rayzero.models.hf") == layer_of("rayzero.models")
    assert layer_of("rayzero.jobs.train") < TOP and layer_of("rayzero.nothing") is None


def test_checker_finds_cycles_through_function_level_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "rayzero" / "fake"
    pkg.mkdir(parents=True)
    (tmp_path / "rayzero" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from rayzero.fake import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "c.py").write_text("import rayzero.fake.a\n")
    (pkg / "d.py").write_text("from rayzero.fake.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "rayzero")
    assert cycles(module_graph()) == [["rayzero.fake.a", "rayzero.fake.b", "rayzero.fake.c", "rayzero.fake.a"]]
