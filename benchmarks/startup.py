"""The first minute: time to the first completed step of `rayzero train` against torchrun.

One run, in rounds (default 3), each round all of:
  1. `rayzero train train.steps=1 --no-progress` as a user's first command: the CLI in a
     process of its own, starting a local Ray of its own (no RAY_ADDRESS) beside its imports
     and checks (`RayStart`), its ranks placed as soon as Ray is up (`place_ahead`), the
     default model (`tiny`) and data (the stdlib corpus, prepared
     before the first round: its first-use preparation is not timed), MLflow and checkpoints
     on, as the defaults have them;
  1a. the same through the CLI's `main` called from Python, which starts Ray after the checks:
     the sequence before Ray's start was begun beside them (the baseline of that change);
  1b. the same with `cluster.dashboard=true`: the local Ray with its dashboard, as every run
     started one before the dashboard was left out (the baseline of that change);
  1c. the same with `tracking.enabled=false`: MLflow's share of a local start (none, since
     MLflow begins only after the first step: `Tracker.begin`);
  2. the same joining a Ray that is already running (`ray start --head`, started once before
     the rounds, as on a cluster or under `ray job submit`): Ray's own start left out;
  2a. the same through the CLI's `main` called from Python, which joins Ray after the checks
     and places the ranks after that: the sequence before the join and the ranks' placement
     were begun beside the checks (the baseline of that change);
  3. the same as 2 with `tracking.enabled=false`: MLflow's share left out as well;
  4. `torchrun --standalone --nproc_per_node 2 benchmarks/torchrun_first_step.py`: the same
     GPT, batch and world size, DDP over gloo, one step;
  5. `python benchmarks/raytrain_first_step.py`: the same in Ray Train's `TorchTrainer`
     (`prepare_model`: DDP over gloo), starting a local Ray of its own as a user's first
     script does (no `ray.init()` in it).
Before the rounds, one untimed run of each (the page cache, the compiled bytecode).

Reported per variant, the median over rounds: the time from the command's launch to its first
status line (rayzero) and to the end of its first step, split by stage (rayzero: its status
lines' stages, from `--summary-json`'s `startup`; torchrun: the launcher, imports, process
group, model, step), and each rayzero variant's ratio to torchrun. For where the rest goes,
costs measured alone on this machine, each in a fresh interpreter: `import torch`, the driver's
imports (`rayzero.jobs.train`: torch, Ray), a rank's (`rayzero.workers.actor`), `ray.init()` of
a local Ray (Ray's own start: GCS, raylet, dashboard and agents), MLflow's start in the driver
(its import and a new sqlite store), and `rayzero --help`.
Targets (issue #50): the first status line within 1 s; the first step within 2.0x torchrun's
starting a local Ray and within 1.5x joining one; and no slower than Ray Train's starting its own.

    python benchmarks/startup.py [--rounds 3] [--json PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
WORLD = 2


def lines_of(cmd: list[str], cwd: Path, env: dict) -> tuple[float, list[tuple[float, str]], int]:
    """Run `cmd`; (its launch wall-clock time, each output line with the seconds after the
    launch it arrived, the exit code)."""
    launch = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    out = [(time.time() - launch, line.rstrip("\n")) for line in proc.stdout]
    return launch, out, proc.wait()


class Failed(RuntimeError):
    pass


def again(run, *args, tries: int = 3) -> dict:
    """`run(*args)`, run again (saying so) if it fails: on a shared machine another user's
    `ray stop --force` kills every local Ray, a run's among them."""
    for i in range(tries):
        try:
            return run(*args)
        except Failed as e:
            if i + 1 == tries:
                raise SystemExit(str(e)) from None
            print(f"{run.__name__} failed ({str(e).splitlines()[-1][:120]}); running it again", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_head(env: dict) -> tuple[str, Path]:
    """A Ray head on loopback with this machine's CPUs (`ray start --head`), as a cluster has
    one running before a job: (its address, its temporary folder)."""
    temp = Path(tempfile.mkdtemp(prefix="rayzero-startup-ray-"))
    port = free_port()
    # Token authentication, as the Ray cluster guide starts one: a token is made only if none exists.
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=60)
    subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                    f"--num-cpus={os.cpu_count()}", "--include-dashboard=false", "--disable-usage-stats",
                    f"--temp-dir={temp}"], env=env, check=True, capture_output=True, timeout=180)
    return f"127.0.0.1:{port}", temp


# The CLI's `main` called from Python, not as the program: Ray's start (or join) begins after the
# checks, and the ranks' placement after that (the sequence every run had before `RayStart` began
# them beside the imports and checks).
AFTER_CHECKS = [sys.executable, "-c", "import sys; from rayzero.jobs.cli import main; sys.exit(main(sys.argv[1:]))"]


def rayzero_round(overrides: list[str], env: dict, program: list[str] | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="rayzero-startup-"))
    cmd = [*(program or [str(BIN / "rayzero")]), "train", "train.steps=1", f"train.output_dir={tmp / 'runs'}",
           "--no-progress", "--summary-json", str(tmp / "s.json"), *overrides]
    _, out, code = lines_of(cmd, tmp, env)
    if code != 0:
        raise Failed("rayzero train failed:\n" + "\n".join(line for _, line in out[-30:]))
    status = [(t, line) for t, line in out if line.startswith("rayzero: [")]
    first_at, first = status[0]
    said = float(first.split("[", 1)[1].split("s]", 1)[0])  # the line's own clock (0.0: its start)
    stages = json.loads((tmp / "s.json").read_text())["startup"]
    return {"first_line_s": first_at, "first_step_s": first_at - said + stages.pop("total_s"),
            "exit_s": out[-1][0] if out else None, "stages": stages, "lines": [line for _, line in status]}


# What a baseline's stamps mark the end of, where its stage is named otherwise
STAGE_NAMES = {"began": "launcher", "imported": "imports", "loop_began": "ray_and_workers"}


def baseline_round(label: str, cmd: list[str], env: dict) -> dict:
    """A baseline script's run: it prints one JSON line of wall-clock stamps, in order, each the
    end of a stage (the first, `began`, the end of the launcher's); each stage's seconds."""
    launch, out, code = lines_of(cmd, HERE, {**env, "OMP_NUM_THREADS": "1"})
    found = [json.loads(line) for _, line in out if line.startswith("{")]
    if code != 0 or not found:
        raise Failed(f"{label} failed:\n" + "\n".join(line for _, line in out[-30:]))
    stamps, before, stages = found[0]["stamps"], launch, {}
    for key, at in stamps.items():
        stages[f"{STAGE_NAMES.get(key, key)}_s"], before = at - before, at
    return {"first_step_s": stamps["first_step"] - launch, "stages": stages}


def torchrun_round(overrides: list[str], env: dict) -> dict:
    return baseline_round("torchrun", [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={WORLD}",
                                       str(HERE / "torchrun_first_step.py"), *overrides], env)


def raytrain_round(overrides: list[str], env: dict) -> dict:
    return baseline_round("Ray Train", [sys.executable, str(HERE / "raytrain_first_step.py"), *overrides], env)


def seconds(cmd: list[str], env: dict) -> float:
    began = time.time()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.time() - began


def median_stages(rows: list[dict]) -> dict:
    keys = list(dict.fromkeys(k for r in rows for k in r["stages"]))
    return {k: statistics.median(r["stages"].get(k, 0.0) for r in rows) for k in keys}


VARIANTS = {  # name: (what it is, whether it joins the running head, extra overrides, the program)
    "local": ("rayzero, starting a local Ray", False, [], None),
    "local_after_checks": ("rayzero, starting a local Ray after the checks", False, [], AFTER_CHECKS),
    "local_dashboard": ("rayzero, starting a local Ray, cluster.dashboard=true", False, ["cluster.dashboard=true"],
                        None),
    "local_no_mlflow": ("rayzero, starting a local Ray, tracking.enabled=false", False, ["tracking.enabled=false"],
                        None),
    "join": ("rayzero, joining a running Ray", True, [], None),
    "join_no_mlflow": ("rayzero, joining a running Ray, tracking.enabled=false", True, ["tracking.enabled=false"],
                       None),
    "join_after_checks": ("rayzero, joining a running Ray after the checks", True, [], AFTER_CHECKS),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="config overrides for both (key=value)")
    args = ap.parse_args()
    overrides = [f"cluster.num_workers={WORLD}", *args.overrides]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    from rayzero.config import load_config
    from rayzero.data.corpus import ensure_default_corpus

    ensure_default_corpus(load_config(None, overrides).data.cache_dir)
    ours: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    theirs: list[dict] = []
    ray_train: list[dict] = []

    def one_round(count: bool) -> None:
        # The local one first, while no head runs: ray.init() would join a head started here.
        ours_now = {name: again(rayzero_round, [*overrides, *extra], env, program)
                    for name, (_, joins, extra, program) in VARIANTS.items() if not joins}
        token_env = {**env, "RAY_AUTH_MODE": "token"}
        address, _ = start_head(token_env)
        try:
            joined = {**token_env, "RAY_ADDRESS": address}
            for name, (_, joins, extra, program) in VARIANTS.items():
                if joins:
                    ours_now[name] = again(rayzero_round, [*overrides, *extra], joined, program)
        finally:
            subprocess.run([str(BIN / "ray"), "stop", "--force"], env=token_env, capture_output=True, timeout=180)
        torchrun = again(torchrun_round, overrides, env)
        raytrain = again(raytrain_round, overrides, env)
        if count:
            for name, row in ours_now.items():
                ours[name].append(row)
            theirs.append(torchrun)
            ray_train.append(raytrain)
            print("round " + str(len(theirs)) + ": " + ", ".join(
                f"{name} first step {row['first_step_s']:.2f} s" for name, row in ours_now.items())
                + f"; torchrun {torchrun['first_step_s']:.2f} s; Ray Train {raytrain['first_step_s']:.2f} s", flush=True)

    one_round(count=False)  # warm-up, not counted
    for _ in range(args.rounds):
        one_round(count=True)
    alone = {
        "import_torch_s": seconds([sys.executable, "-c", "import torch"], env),
        "import_driver_s": seconds([sys.executable, "-c", "import rayzero.jobs.train"], env),
        "import_rank_s": seconds([sys.executable, "-c", "import rayzero.workers.actor"], env),
        "ray_init_s": seconds([sys.executable, "-c", "import ray; ray.init(logging_level='ERROR'); ray.shutdown()"],
                              env) - seconds([sys.executable, "-c", "import ray"], env),
        "mlflow_start_s": seconds([sys.executable, "-c", MLFLOW_START.format(
            uri=f"sqlite:///{tempfile.mkdtemp(prefix='rayzero-startup-mlflow-')}/mlflow.db")], env),
        "cli_help_s": seconds([str(BIN / "rayzero"), "--help"], env),
    }
    torchrun_s = statistics.median(r["first_step_s"] for r in theirs)
    raytrain_s = statistics.median(r["first_step_s"] for r in ray_train)
    med = {"torchrun_first_step_s": torchrun_s, "ray_train_first_step_s": raytrain_s}
    for name, rows in ours.items():
        med[f"{name}_first_line_s"] = statistics.median(r["first_line_s"] for r in rows)
        med[f"{name}_first_step_s"] = statistics.median(r["first_step_s"] for r in rows)
        med[f"{name}_ratio"] = med[f"{name}_first_step_s"] / torchrun_s
        med[f"{name}_ray_train_ratio"] = med[f"{name}_first_step_s"] / raytrain_s
    print("\nrayzero's status lines (last round, starting a local Ray):\n"
          + "\n".join(f"  {line}" for line in ours["local"][-1]["lines"]))
    print(f"\nmedian of {args.rounds} rounds, {WORLD} ranks, gloo, one step ({' '.join(overrides)}), seconds:")
    names = list(VARIANTS)
    print("| stage | " + " | ".join(VARIANTS[n][0] for n in names) + " |")
    print("|---|" + "---|" * len(names))
    print("| launch to the first status line | "
          + " | ".join(f"{med[f'{n}_first_line_s']:.2f}" for n in names) + " |")
    stages = {n: median_stages(ours[n]) for n in names}
    for key in dict.fromkeys(k for n in names for k in stages[n]):
        print(f"| {key[:-2].replace('_', ' ')} | " + " | ".join(f"{stages[n].get(key, 0.0):.2f}" for n in names) + " |")
    print("| **launch to the first step's end** | "
          + " | ".join(f"**{med[f'{n}_first_step_s']:.2f}**" for n in names) + " |")
    print("| **ratio to torchrun** | " + " | ".join(f"**{med[f'{n}_ratio']:.2f}x**" for n in names) + " |")
    print("| **ratio to Ray Train** | " + " | ".join(f"**{med[f'{n}_ray_train_ratio']:.2f}x**" for n in names) + " |")
    for label, rows, total in (("torchrun", theirs, torchrun_s), ("Ray Train, starting a local Ray", ray_train,
                                                                   raytrain_s)):
        print(f"\n| {label} stage | seconds |\n|---|---|")
        for k, v in median_stages(rows).items():
            print(f"| {k[:-2].replace('_', ' ')} | {v:.2f} |")
        print(f"| **launch to the first step's end** | **{total:.2f}** |")
    print("\n| alone, in a fresh interpreter | seconds |\n|---|---|")
    for k, v in alone.items():
        print(f"| {ALONE[k]} | {v:.2f} |")
    first_line = max(med[f"{n}_first_line_s"] for n in names)
    limit = {n: 1.5 if VARIANTS[n][1] else 2.0 for n in names}  # joining a running Ray / starting one
    print(f"\nfirst status line <= 1 s: {'yes' if first_line <= 1 else 'NO'} (at most {first_line:.2f} s); "
          "first step vs torchrun's (<= 2.0x starting a local Ray, <= 1.5x joining): " + ", ".join(
              f"{n} {'yes' if med[f'{n}_ratio'] <= limit[n] else 'NO'} ({med[f'{n}_ratio']:.2f}x)" for n in names)
          + f"; starting a local Ray no slower than Ray Train's: "
          f"{'yes' if med['local_ray_train_ratio'] <= 1.0 else 'NO'} ({med['local_ray_train_ratio']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"median": med, "alone": alone, "rayzero": ours, "torchrun": theirs,
                                               "ray_train": ray_train}, indent=2))


MLFLOW_START = ("from mlflow.tracking import MlflowClient; c = MlflowClient(tracking_uri={uri!r}); "
                "c.create_run(c.create_experiment('startup'))")
ALONE = {"import_torch_s": "python -c 'import torch'", "import_driver_s": "the driver's imports (rayzero.jobs.train)",
         "import_rank_s": "a rank's imports (rayzero.workers.actor)",
         "ray_init_s": "ray.init() of a local Ray, less `import ray`",
         "mlflow_start_s": "MLflow's start in the driver: import, a new sqlite store, a run",
         "cli_help_s": "rayzero --help"}


if __name__ == "__main__":
    main()
