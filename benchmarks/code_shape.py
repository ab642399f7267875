"""The shape of the code one training step runs, measured: how much a reader must follow.

- **A step's reach**: two ranks (gloo, plain processes) train a small GPT; the third iteration
  of rank 0 runs under `sys.setprofile`, which records every rayzero function called (Python
  functions only; torch's are not counted). Reported per strategy: the files and the functions,
  and the files listed; the JSON also has each file's functions (`by_file`) and where each file
  is entered from another (`entered_from`: the callee and the caller's file:line).
- **Policies reading the strategy**: reads of `self.s` (the strategy a policy once held) in the
  policy files of `rayzero/sharding/` (grad_sync, placement, fsdp, ownership).
- **Axis names asked for outside mesh.py**: `mesh.axis/size/coord/groups("<axis>")` calls whose
  literal argument is an axis name but not a role (the mesh refuses them, so this should be 0),
  and direct `cfg.parallel.*` reads outside the config and mesh modules: of an axis's size
  (`tp`, `pp`, `cp`, `ep`: the mesh's to answer, by role) and of its options (a schedule, a mode).
- **Long functions**: functions over 60 lines in `rayzero/sharding`, `rayzero/workers`,
  `rayzero/pipeline`.

    python benchmarks/code_shape.py [--strategies optim_grads_params no_shard] [--json PATH]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "rayzero"
POLICIES = ("grad_sync.py", "placement.py", "fsdp.py", "ownership.py")


def _rank(rank: int, world: int, port: int, data: str, strategy: str, out) -> None:
    from rayzero.config import load_config
    from rayzero.workers.rank import Rank

    torch.set_num_threads(1)
    cfg = load_config(None, [f"cluster.num_workers={world}", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
                             "train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
                             f"sharding.strategy={strategy}"])
    r = Rank(cfg, rank, world, data)
    r.setup("127.0.0.1", port)
    for k in range(2):
        r.iteration({"step": k, "lr": 1e-3})
    seen: set[tuple[str, str]] = set()
    calls: set[tuple[str, str, str]] = set()  # (callee's file, its function, the caller's file:line) across files

    def profile(frame, event, _arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(str(PKG)):
                where = os.path.relpath(code.co_filename, ROOT)
                seen.add((where, code.co_qualname))
                back = frame.f_back
                if back is not None and back.f_code.co_filename != code.co_filename:
                    calls.add((where, code.co_qualname, f"{os.path.relpath(back.f_code.co_filename, ROOT)}:{back.f_lineno}"))

    sys.setprofile(profile)
    try:
        r.iteration({"step": 2, "lr": 1e-3})
    finally:
        sys.setprofile(None)
    if rank == 0:
        out[strategy] = (sorted(seen), sorted(calls))
    r.close()


def step_reach(strategies: list[str]) -> dict[str, dict]:
    from rayzero.data.tokens import prepare

    tmp = Path(tempfile.mkdtemp())
    texts = tmp / "texts"
    texts.mkdir()
    src = Path(json.__file__).parent
    for f in sorted(src.glob("*.py")):
        (texts / f.name).write_text(f.read_text())
    prepare(texts, str(tmp / "data"), pattern="*.py", row_group_tokens=1 << 14)
    from tests.conftest import free_port

    result = {}
    with mp.Manager() as manager:
        out = manager.dict()
        for strategy in strategies:
            mp.spawn(_rank, args=(2, free_port(), str(tmp / "data"), strategy, out), nprocs=2)
        for strategy in strategies:
            seen, calls = out[strategy]
            files = sorted({f for f, _ in seen})
            result[strategy] = {"files": len(files), "functions": len(seen), "list": files,
                                "by_file": {f: sorted(q for g, q in seen if g == f) for f in files},
                                "entered_from": {f: sorted(f"{q} <- {c}" for g, q, c in calls if g == f) for f in files}}
    return result


def _sources(*dirs: str):
    for d in dirs:
        for path in sorted((PKG / d).rglob("*.py")) if d else sorted(PKG.glob("*.py")):
            yield path, ast.parse(path.read_text())


def policy_strategy_reads() -> dict[str, int]:
    out = {}
    for name in POLICIES:
        tree = ast.parse((PKG / "sharding" / name).read_text())
        out[name] = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "s"
                        and isinstance(node.value, ast.Name) and node.value.id == "self")
    return out


def axis_lookups() -> dict[str, int]:
    from rayzero.sharding.mesh import KEYS, ORDER, ROLES

    axis_only = set(ORDER) - set(ROLES)
    size_keys = {key.partition(".")[2] for key in KEYS.values() if key.startswith("parallel.")}  # tp, pp, cp, ep
    names, parallel, sizes = 0, 0, 0
    for path, tree in _sources("", "sharding", "workers", "pipeline", "jobs", "cluster", "checkpoint", "models",
                               "objectives", "data"):
        if path.name in ("mesh.py", "config.py"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("axis", "size", "coord", "groups", "my_group") and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in axis_only):
                names += 1
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "parallel"):
                parallel += 1
                sizes += node.attr in size_keys
    return {"axis_names_outside_mesh": names, "cfg_parallel_reads": parallel, "cfg_axis_size_reads": sizes}


def long_functions(limit: int = 60) -> list[str]:
    out = []
    for path, tree in _sources("sharding", "workers", "pipeline"):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.name} ({n} lines)")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="+", default=["optim_grads_params", "no_shard"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    report = {"step": step_reach(args.strategies), "policy_reads_of_strategy": policy_strategy_reads(),
              **axis_lookups(), "functions_over_60_lines": long_functions()}
    for strategy, r in report["step"].items():
        print(f"{strategy}: one iteration runs {r['functions']} rayzero functions in {r['files']} files")
        for f in r["list"]:
            print(f"    {f}")
    print(f"policies reading the strategy: {sum(report['policy_reads_of_strategy'].values())} "
          f"{report['policy_reads_of_strategy']}")
    print(f"axis names asked for outside mesh.py: {report['axis_names_outside_mesh']}; "
          f"cfg.parallel reads outside config/mesh: {report['cfg_parallel_reads']} "
          f"(axis sizes: {report['cfg_axis_size_reads']}; the rest an axis's options: schedules, modes)")
    print(f"functions over 60 lines: {len(report['functions_over_60_lines'])}")
    for f in report["functions_over_60_lines"]:
        print(f"    {f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
