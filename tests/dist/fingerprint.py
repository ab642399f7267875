"""Every generated configuration's run, reduced to what a change that must not change behaviour
compares: each step's loss and token sums, gradient norm, router losses and objective metrics,
and the final weights, main parameters and Adam moments of every rank, hashed bit for bit.

    python -m tests.dist.fingerprint OUT.json            # this tree's
    python -m tests.dist.fingerprint --compare A.json B.json

Run it in a checkout of the commit before a change (`git worktree add`, this file copied in if it
is newer) and in the tree after, then `--compare`: every configuration must match bit for bit.
It builds the models and data as test_combinations.py's `combo_setup` does, on its own (it must
run unchanged in a checkout from before a change), and drives each rank as
`tests/dist/combination_ranks.py` does (setup, then `iteration` per step), reading only what a
rank has returned at every commit since the step results were merged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def objective_metrics(res: dict) -> dict:
    """The step's objective metrics' sums, under whichever key the tree reports them."""
    for key in ("prefs", "objective"):  # a flat dict of sums before the objective seam; {"sum", "max"} after
        if res.get(key):
            got = res[key]
            parts = (got["sum"], got["max"]) if "sum" in got else (got,)
            return {k: v for part in parts for k, v in part.items() if k != "loss"}  # the loss: loss_sum
    return {}


def _rank(rank: int, world: int, cfg, data: str, port: int, rollouts: list | None, out: dict):
    from rayzero.cluster.schedule import lr_at
    from rayzero.workers.rank import Rank
    from tests.combinations import STEPS

    torch.set_num_threads(1)
    r = Rank(cfg, rank, world, data)
    r.setup("127.0.0.1", port)
    steps = []
    for k in range(STEPS):
        res = r.iteration({"step": k, "lr": lr_at(k, STEPS, cfg.optim), "evaluate": k == STEPS - 1,
                           **({"rollout": rollouts[k]} if rollouts else {})})
        steps.append({**{key: res.get(key) for key in ("loss_sum", "tokens", "grad_norm", "aux_loss_sum",
                                                       "z_loss_sum", "val_loss_sum", "val_tokens")},
                      "metrics": objective_metrics(res)})
    opt = r.strategy.optimizer
    state = r.full_state_dict()
    out[rank] = {"steps": steps,
                 "state": digest([state[k] for k in sorted(state)]) if state is not None else None,
                 "main": digest(r.strategy.main_params), "moments": digest([opt.exp_avg, opt.exp_avg_sq])}
    r.close()


def setup(root: Path) -> dict:
    """The models and data of tests/dist/test_combinations.py's `combo_setup`."""
    from rayzero.data.tokens import prepare
    from tests import combinations as combos
    from tests.dist.test_dpo import pairs
    from tests.models import save_hf_model, save_tokenizer
    from tests.unit.test_packed import records

    src = Path(sys.modules["json"].__file__).parent.parent
    texts = root / "texts"
    texts.mkdir()
    for pkg in ("json", "email", "asyncio"):
        for f in sorted((src / pkg).glob("*.py")):
            (texts / f"{pkg}_{f.name}").write_text(f.read_text())
    prepare(texts, str(root / "small"), pattern="*.py", row_group_tokens=1 << 14)
    dirs = combos.save_models(root)
    tok = save_hf_model("llama", root / "tokenizer")
    save_tokenizer(tok, [Path(sys.modules["json"].__file__).read_text()], vocab=250)
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs(40)))
    prepare(root / "pairs.jsonl", str(root / "pairs"), tokenizer=str(tok), preferences=True)
    (root / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(60)))
    prepare(root / "examples.jsonl", str(root / "examples"), tokenizer=str(tok), instructions=True)
    prompts, replay = combos.save_rollouts(root, tok)
    return {"dirs": dirs, "text": str(root / "small"), "pairs": str(root / "pairs"),
            "examples": str(root / "examples"), "prompts": prompts, "replay": replay, "root": root}


def run(out_path: str, only: list[str] | None) -> None:
    import torch.multiprocessing as mp

    from tests import combinations as combos
    from tests.conftest import free_port
    from tests.dist.pool import spawn
    from tests.dist.test_combinations import config_of, data_of

    results = {}
    manager = mp.Manager()
    with tempfile.TemporaryDirectory() as tmp:
        s = setup(Path(tmp))
        for c in combos.CONFIGS:
            name = combos.label(c)
            if only and not any(o in name for o in only):
                continue
            c = {**c, "resume": False}
            t0 = time.perf_counter()
            got = manager.dict()
            world = combos.world(c)
            cfg, data = config_of(c, s), data_of(c, s)
            spawn(_rank, args=(world, cfg, data, free_port(), combos.rollout_plans(cfg, data), got), nprocs=world)
            results[name] = [got[r] for r in range(world)]
            print(f"{time.perf_counter() - t0:6.1f} s  {name}", flush=True)
    Path(out_path).write_text(json.dumps(results, indent=1, sort_keys=True))


def _normal(runs: dict) -> dict:
    """The metrics without the loss's own sum (compared as `loss_sum`)."""
    for ranks in runs.values():
        for rank in ranks:
            for step in rank["steps"]:
                step["metrics"].pop("loss", None)
    return runs


def compare(a: str, b: str) -> int:
    x, y = (_normal(json.loads(Path(p).read_text())) for p in (a, b))
    common = sorted(set(x) & set(y))
    differ = [n for n in common if x[n] != y[n]]
    for n in differ:
        print(f"differs: {n}")
        for r, (u, v) in enumerate(zip(x[n], y[n])):
            for key in u:
                if u[key] != v.get(key):
                    print(f"  rank {r} {key}: {str(u[key])[:200]}\n  {' ' * len(str(r))}      {str(v.get(key))[:200]}")
    print(f"{len(common) - len(differ)} of {len(common)} configurations bitwise equal"
          f" ({len(set(x) ^ set(y))} in one file only)")
    return 1 if differ or not common else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--only", nargs="*", help="configurations whose label contains one of these")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    sys.exit(compare(*args.compare) if args.compare else run(args.out, args.only))
