"""Where the test suite's CPU goes: by kind of process, and by the test file that started them.

    python benchmarks/suite_cpu.py [--json runs/cpu.json] -- [pytest arguments]   # e.g. -- tests/e2e

Runs pytest (this interpreter's, with the arguments after `--`) while it reads every process's
CPU time from /proc twice a second, and reports, for the run:
- the wall time, the CPU time of every process that ran meanwhile and what share of the
  machine's cores that kept busy (a suite that keeps them busy is shortened only by doing less);
- the CPU by kind of process: the pytest process, rank processes (Ray actors by class, the
  gloo tier's kept rank processes), Ray's own (raylet, GCS, dashboard and its agent, the log
  monitor, Compiled Graph's driver proxies), `rayzero` and `mlflow` processes, ... with how many
  there were and the least one took (for rank processes: the start alone, imports and all);
- the processes each test file started (those that appeared while its tests ran), as CPU
  seconds and counts.
A process alive before the run counts only its CPU during it. A process that lives less than half
a second can be missed, and the CPU of one that ends between two readings counts up to the
reading before. Linux only.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


class Process:
    def __init__(self, cmdline: str, name: str, first_seen: float, cpu_then: float):
        self.cmdline, self.name, self.first_seen = cmdline, name, first_seen
        self.cpu0 = cpu_then  # CPU it had when first seen before the run began, else 0
        self.cpu = cpu_then

    @property
    def used(self) -> float:
        return self.cpu - self.cpu0


def sample(procs: dict[int, Process], now: float, before_run: bool) -> None:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            fields = rest.split()
            cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime, every thread
            p = procs.get(pid)
            if p is None:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:400]
                p = procs[pid] = Process(cmdline, name, now, cpu if before_run else 0.0)
            p.cpu = max(p.cpu, cpu)
            if name.startswith("ray::") and "IDLE" not in name:
                p.name = name  # a Ray worker is named for its actor once it has one
        except (OSError, IndexError, ValueError):
            pass  # it ended meanwhile


def kind(p: Process) -> str:
    """What a process is, from its name (Ray's workers: `ray::Class`) and command line."""
    cmd = p.cmdline
    if p.name.startswith("ray::") and "IDLE" not in p.name:
        return "Compiled Graph's driver proxy" if p.name.startswith("ray::DAGDriverP") else f"actor {p.name[5:]}"
    for needle, what in (("ray-dashboard", "Ray dashboard"), ("resource_tracker", "multiprocessing's helpers"),
                         ("multiprocessing.forkserver", "multiprocessing's helpers"),
                         ("multiprocessing.spawn", "gloo-tier rank process (tests/dist/pool.py)"),
                         ("default_worker.py", "Ray worker without an actor"), ("gcs_server", "Ray GCS"),
                         ("log_monitor", "Ray log monitor"), ("dashboard/agent.py", "Ray dashboard agent"),
                         ("dashboard/dashboard.py", "Ray dashboard"),
                         ("runtime_env/agent", "Ray runtime-env agent"), ("/raylet", "Ray raylet"),
                         ("monitor.py", "Ray monitor"), ("-m pytest", "pytest"), ("bin/pytest", "pytest"),
                         ("bin/rayzero", "rayzero command"), ("mlflow", "mlflow"), ("weed", "SeaweedFS"),
                         ("ipykernel", "notebook kernel"), ("bin/ray ", "ray command")):
        if needle in cmd:
            return what
    return f"other: {p.name}"


# -- as a pytest plugin (`-p suite_cpu`, in the pytest process): when each test file began ------
def pytest_runtest_logstart(nodeid, location):
    """Appends "time file" to $SUITE_CPU_STARTS when a test begins (the file of its node id)."""
    with open(os.environ["SUITE_CPU_STARTS"], "a") as f:
        f.write(f"{time.time()} {nodeid.split('::')[0].removeprefix('tests/').removesuffix('.py')}\n")


def file_spans(starts: Path) -> tuple[list[float], list[str]]:
    """When every test started, in order, and its file."""
    rows = [line.split(" ", 1) for line in starts.read_text().splitlines()] if starts.exists() else []
    return [float(t) for t, _ in rows], [f for _, f in rows]


def file_at(spans: tuple[list[float], list[str]], when: float) -> str:
    """The file of the last test that began before `when`."""
    i = bisect.bisect_right(spans[0], when)
    return spans[1][i - 1] if i else "before the first test"


def report(procs: dict[int, Process], wall: float, spans: tuple[list[float], list[str]], top: int = 15) -> dict:
    cores = os.cpu_count() or 1
    total = sum(p.used for p in procs.values())
    kinds = {pid: kind(p) for pid, p in procs.items() if p.used > 0}
    by_kind: dict[str, list[float]] = defaultdict(list)
    for pid, k in kinds.items():
        by_kind[k].append(procs[pid].used)
    print(f"wall {wall:.0f} s; CPU {total:.0f} s over every process: {100 * total / (wall * cores):.0f} % of "
          f"{cores} cores\n")
    print("| process | CPU s | share | processes | least one | median one |\n|---|---|---|---|---|---|")
    for k, xs in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))[:top]:
        xs.sort()
        print(f"| {k} | {sum(xs):.0f} | {100 * sum(xs) / total:.1f} % | {len(xs)} | {xs[0]:.1f} | "
              f"{xs[len(xs) // 2]:.1f} |")
    by_file: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    if spans[0]:
        for pid, k in kinds.items():
            if k != "pytest":
                by_file[file_at(spans, procs[pid].first_seen)][k].append(procs[pid].used)
        print("\nThe processes each file started, by when they appeared (long-lived ones, such as the session's "
              "Ray head or the gloo tier's kept ranks, fall on the first file that needed them):\n")
        print("| file | CPU s | processes (CPU s / count) |\n|---|---|---|")
        for f, started in sorted(by_file.items(), key=lambda kv: -sum(map(sum, kv[1].values())))[:top]:
            parts = sorted(started.items(), key=lambda kv: -sum(kv[1]))[:5]
            print(f"| {f} | {sum(map(sum, started.values())):.0f} | "
                  + ", ".join(f"{k} {sum(xs):.0f}/{len(xs)}" for k, xs in parts) + " |")
    return {"wall_s": wall, "cpu_s": total, "cores": cores,
            "by_kind": {k: {"cpu_s": sum(xs), "processes": len(xs)} for k, xs in by_kind.items()},
            "by_file": {f: {k: {"cpu_s": sum(xs), "processes": len(xs)} for k, xs in started.items()}
                        for f, started in by_file.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between two readings of /proc")
    ap.add_argument("pytest_args", nargs="*", help="after `--`: pytest's arguments")
    args = ap.parse_args()
    starts = Path(os.environ.get("TMPDIR", "/tmp")) / f"suite_cpu_{os.getpid()}.starts"
    starts.unlink(missing_ok=True)
    procs: dict[int, Process] = {}
    sample(procs, time.time(), before_run=True)
    done = threading.Event()

    def sampler():
        while not done.wait(args.interval):
            sample(procs, time.time(), before_run=False)

    thread = threading.Thread(target=sampler, daemon=True)
    started = time.time()
    thread.start()
    env = {**os.environ, "SUITE_CPU_STARTS": str(starts),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_cpu", *args.pytest_args], env=env)
    done.set()
    thread.join()
    sample(procs, time.time(), before_run=False)
    wall = time.time() - started
    procs.pop(os.getpid(), None)  # this script's own reading
    spans = file_spans(starts)
    figures = report(procs, wall, spans)
    if args.json:
        args.json.write_text(json.dumps({**figures, "pytest_exit": code}, indent=1))
    sys.exit(code)


if __name__ == "__main__":
    main()
