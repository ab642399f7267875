"""Run one benchmark and keep its results where the benchmarks page is drawn from.

    python benchmarks/record.py NAME -- benchmarks/startup.py --rounds 2

runs the script with `--json` added, then writes `benchmarks/results/NAME.json`: what the
script wrote, with the command that reproduces it (the script and its arguments), the date, the
commit it ran at, the hardware and the versions of Python, torch, Ray, transformers, PEFT and TRL.
`python benchmarks/figures.py` then draws the page's figures and tables from those files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PACKAGES = ("torch", "ray", "transformers", "peft", "trl")


def hardware() -> dict:
    """The machine: its CPU model, cores, memory and GPUs (by name)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch, or a CUDA build on a machine without a driver
        gpus = []
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory, 1), "gpus": gpus}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def commit() -> dict:
    """The commit the benchmark ran at, and whether the code it ran (rayzero/, benchmarks/ but what
    records and draws the results) differed from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--", "rayzero", "benchmarks", ":!benchmarks/results",
                  ":!benchmarks/record.py", ":!benchmarks/figures.py").splitlines()
    return {"commit": git("rev-parse", "--short=7", "HEAD"), "code_changed": bool(changed),
            "changed_files": sorted(line[3:] for line in changed)}


def record(name: str, script_args: list[str]) -> Path:
    command = "python " + shlex.join(script_args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        started = time.time()
        subprocess.run([sys.executable, *script_args, "--json", str(out)], cwd=ROOT, check=True)
        seconds = time.time() - started
        results = json.loads(out.read_text())
    kept = {"name": name, "command": command, "date": datetime.date.today().isoformat(), **commit(),
            "hardware": hardware(), "versions": versions(), "seconds": round(seconds, 1), "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(kept, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the results' file name, benchmarks/results/NAME.json")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- the benchmark script and its arguments")
    args = ap.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("name the benchmark to run after --")
    print(f"wrote {record(args.name, script).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
