"""The examples of the README and of every page of the documentation site (mkdocs.yml's nav, in
its order): every ```bash and ```python block of a page, in the page's order, in a fresh copy of
the repository as a clone has it (`git ls-files`, and the untracked files git does not ignore),
each page in a copy of its own, as a user who lands on it and pastes its commands one after
another: each gets what it promises, and every training command trains (none finds an earlier
example's checkpoints and has nothing to train, or is refused as another model), with no
warning the page does not show. The blocks are
read when the test runs, so the pages and this test stay in step: a command that cannot run here
must be named in SKIPPED or REPLACED, a page's text the test substitutes must still be there,
and an entry no command of any page matches any more fails the test as well.

Where the test differs from a user's terminal, and why:
- Set-up is this venv, its bin first on PATH: making it, the `pip install`s, `source
  .venv/bin/activate`.
- `ray get-auth-token --generate` and `ray start --head` are the session's head node (the
  `ray_head` fixture runs the same two commands); `ray job submit`, `status` and `logs` go to it
  for real, through its dashboard (a submission the head refuses because its job agent is not up
  yet, `No available agent to submit job, please try again later`, is tried again, for up to a
  minute, as a user would). Every other run joins that head (RAY_ADDRESS, as a job's
  driver has it) instead of starting a Ray of its own: test_cli.py starts one.
- `rayzero` and `python` commands run in this process (the CLI's `main`, a script by runpy,
  `python -c` by exec) with their arguments as bash expands them: what is tested here is the
  commands, not the entry point (test_cli.py runs that), and a process costs ~5 s of imports.
- Runs are shortened 25 times: `train.steps=N` (100 where a command leaves it to the default or
  its config file) becomes N/25 (4 steps of the default 100, 8 of a resume to 200), in the
  Python blocks `"steps": N` too; MLflow off after the first command that trains (which shows
  it); a 4-rank run at half a CPU a rank, as the head has 2. Every `rayzero train` and every `fit()` keeps its rank processes for
  the next one placed alike (`cluster.keep_ranks=true`, as `train_here` runs do); they are
  released before a command of another process (`ray job submit`) needs the head's CPUs.
- The S3 block runs against the session's SeaweedFS (`s3_server`): its endpoint for
  http://127.0.0.1:8333, a bucket of the test's own (made with the server, as a team's exists),
  its keys only as the AWS_* variables of this process, as a user exports them: the run gives
  them to its ranks (processes the head started, without those variables).
- A GPU run (`cluster.use_gpu=true`) runs on this machine's CPU, the flag left out.
- `rayzero deploy check --crds path/to/crds` takes KubeRay's CRDs beside the project
  (../shared/kuberay/crds, as tests/unit/test_kuberay.py does); without them it runs without
  `--crds`, and the schema is skipped with rayzero's own note.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import cli_in_process
from rayzero import Trainer, release_ranks
from tests.e2e.conftest import BIN, KEEP, leftovers
from tests.e2e.test_job_submit import job_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared/kuberay/crds"
SHORTER = 25  # a run's steps divided by this (100 -> 4)

# Commands this machine cannot run, by their first words, with the reason.
SKIPPED = {
    ".venv/bin/python -m pytest": "the whole suite, this test among it",
    "docker build": "needs docker, and pulls Ray's GPU image",
    "kubectl": "needs a Kubernetes cluster with the KubeRay operator",
    ".venv/bin/mkdocs serve": "a server that runs until stopped; tests/unit/test_docs.py builds the site",
}
# Commands whose effect the test provides itself (see the module's docstring).
REPLACED = {
    "python3 -m venv .venv": "this venv",
    ".venv/bin/pip install": "this venv, where rayzero is installed",
    "source .venv/bin/activate": "this venv's bin is first on PATH",
    "ray get-auth-token --generate": "the session's head node made the token",
    "ray start --head": "the session's head node",
}


@dataclass
class Command:
    text: str  # as the page has it: continuation lines joined, the comment left out
    where: str  # page:line
    expect: list[str] = field(default_factory=list)  # the output the page shows under it (`# ...` lines)

    @property
    def words(self) -> list[str]:
        """Its words, the variable assignments before the program left out."""
        words = self.text.split()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words.pop(0)
        return words

    def starts_with(self, key: str) -> bool:
        return self.words[: len(key.split())] == key.split()


def pages() -> list[str]:
    """The README, then the site's pages in the order of mkdocs.yml's nav."""
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml names Python objects (`!!python/name:`); not needed here
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]

    def flat(entries) -> list[str]:
        out = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out += flat(value) if isinstance(value, list) else [f"docs/{value}"]
        return out

    return ["README.md", *flat(nav)]


def blocks(page: str) -> list[tuple[str, int, str]]:
    """(language, line, text) of every ```bash and ```python block of `page`, in order."""
    text = (ROOT / page).read_text()
    return [(m["lang"], text[: m.start()].count("\n") + 2, m["body"])
            for m in re.finditer(r"^```(?P<lang>bash|python)\n(?P<body>.*?)^```$", text, re.M | re.S)]


def bash_commands(text: str, where: str, first_line: int) -> list[Command]:
    """A bash block's commands: a line (with its continuation lines) split at `&&`; the comment
    lines right under a command are the output the page shows for it."""
    commands: list[Command] = []
    lines, i = text.splitlines(), 0
    while i < len(lines):
        start, line = i, lines[i].rstrip()
        i += 1
        if line.lstrip().startswith("#"):
            assert commands, f"{where}:{first_line + start}: a comment before any command"
            commands[-1].expect.append(line.lstrip()[1:].strip())
            continue
        while line.endswith("\\"):
            line, i = line[:-1] + " " + lines[i].strip(), i + 1
        line = without_comment(line).strip()
        commands += [Command(part.strip(), f"{where}:{first_line + start}") for part in line.split(" && ")
                     if part.strip()]
    return commands


def without_comment(line: str) -> str:
    """The line up to a `#` that begins a word outside quotes, as bash reads it."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shortened(steps: int) -> int:
    return max(1, round(steps / SHORTER))


def clone_of_the_repository(to: Path) -> Path:
    """The files a clone would have: tracked, and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in this working tree is not there
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


class Walk:
    """Runs the pages' commands one after another, each page in a fresh copy of the repository,
    and remembers what they said."""

    def __init__(self, ray_head, s3_server, capsys, monkeypatch, caplog):
        self.ray_head = ray_head
        self.capsys, self.monkeypatch, self.caplog = capsys, monkeypatch, caplog
        self.clone = Path()
        self.checkpoint_dirs: set[str] = set()  # where the current page's runs trained
        bucket = "readme"
        # A page's text -> what it is here; each must be found in some page.
        self.substitutions = {
            "http://127.0.0.1:8265": ray_head.dashboard,
            "http://127.0.0.1:8333": s3_server.endpoint,
            "s3://bucket/": f"s3://{bucket}/",
            " --crds path/to/crds": f" --crds {CRDS}" if CRDS.is_dir() else "",
            " cluster.use_gpu=true": "",  # this machine has no GPU: the same run on its CPU
        }
        self.used: set[str] = set()
        self.job = ""  # the submission id `ray job submit` printed
        self.trained = 0  # training commands that trained
        self.transcript: list[str] = []
        self.seconds: list[tuple[float, str]] = []  # what each command took, for the test's output
        for key, value in {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_ADDRESS": ray_head.address,
                           "RAY_AUTH_MODE": "token", "AWS_ACCESS_KEY_ID": s3_server.KEY,
                           "AWS_SECRET_ACCESS_KEY": s3_server.SECRET, "AWS_DEFAULT_REGION": s3_server.REGION}.items():
            monkeypatch.setenv(key, value)
        fit = Trainer.fit

        def fit_keeping(trainer):  # a Python block's fit() keeps its ranks, as KEEP on the command line
            trainer.config = trainer.config.override(KEEP)
            return fit(trainer)

        monkeypatch.setattr(Trainer, "fit", fit_keeping)

    def page(self, page: str, clone: Path) -> None:
        """Every block of `page` in order, in `clone` (a fresh copy of the repository)."""
        self.clone = clone
        self.checkpoint_dirs = set()
        self.monkeypatch.chdir(clone)
        self.monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)  # what an earlier page exported
        started = time.monotonic()
        for lang, line, text in blocks(page):
            if lang == "python":
                self.python_block(text, f"{page}:{line}")
            else:
                for cmd in bash_commands(text, page, line):
                    self.run(cmd)
        self.seconds.append((time.monotonic() - started, f"{page}: the whole page"))

    def said(self, text: str) -> str:
        """The transcript's end, for a failure's message."""
        return "\n".join(self.transcript)[-6000:] + "\n" + text[-4000:]

    def substitute(self, text: str) -> str:
        for page_text, here in self.substitutions.items():
            if page_text in text:
                self.used.add(page_text)
                text = text.replace(page_text, here)
        return text.replace("raysubmit_…", self.job)

    def argv(self, text: str) -> list[str]:
        """The words bash makes of `text` here: quotes, globs, ~ and variables expanded."""
        r = subprocess.run(["bash", "-c", f'set -- {text}\nprintf "%s\\0" "$@"'], capture_output=True, text=True,
                           check=True, cwd=self.clone)
        return r.stdout.split("\0")[:-1]

    def run(self, cmd: Command) -> None:
        for table in (SKIPPED, REPLACED):
            key = next((k for k in table if cmd.starts_with(k)), None)
            if key is not None:
                self.used.add(key)
                self.transcript.append(f"{cmd.where}: {cmd.text}  [{table[key]}]")
                return
        self.transcript.append(f"{cmd.where}: $ {cmd.text}")
        started = time.monotonic()
        program = Path(cmd.words[0]).name
        text = self.substitute(cmd.text)
        if program == "rayzero":
            out = self.rayzero(self.argv(text)[1:], cmd)
        elif program in ("python", "python3"):
            out = self.python(self.argv(text)[1:])
        elif program == "export":
            for assignment in self.argv(text)[1:]:
                self.monkeypatch.setenv(*assignment.split("=", 1))
            out = ""
        else:
            out = self.shell(text, cmd)
        for line in cmd.expect:
            assert line in out, self.said(f"{cmd.where}: the page shows {line!r} in its output:\n{out}")
        self.seconds.append((time.monotonic() - started, f"{cmd.where}: {cmd.text}"))

    def rayzero(self, argv: list[str], cmd: Command) -> str:
        training = argv[0] == "train" and "--dry-run" not in argv
        if training:
            steps = [int(a.split("=", 1)[1]) for a in argv if a.startswith("train.steps=")]
            argv += [f"train.steps={shortened(steps[-1] if steps else 100)}", KEEP]
            if self.trained:
                argv.append("tracking.enabled=false")
            if "cluster.num_workers=4" in argv:
                argv.append("cluster.cpus_per_worker=0.5")
        code, out, err = cli_in_process(self.capsys, self.monkeypatch, self.clone, *argv)
        self.transcript.append(out[-1500:] + err[-1500:])
        assert code == 0, self.said(f"{cmd.where}: exit code {code}\n{err}\n{self.caplog.text}")
        warned = [line for line in err.splitlines() if line.startswith("rayzero: warning")]
        shown = [w for w in warned if any(e in w for e in cmd.expect)]
        assert warned == shown, self.said(f"{cmd.where}: a warning the page does not show: {warned}")
        if training:
            self.assert_trained(out, cmd)
            ckpt = ([a.split("=", 1)[1] for a in argv if a.startswith("checkpoint.dir=")] or ["checkpoints"])[-1]
            if "--config" not in argv and ckpt:  # (a config file may name its own checkpoint.dir; "" keeps none)
                # A page's run into a checkpoint.dir an earlier run of the page trained in goes on
                # from its commit, and says so before it starts; any other starts afresh.
                again = ckpt in self.checkpoint_dirs
                assert ("rayzero: resuming from" in err) == again, self.said(
                    f"{cmd.where}: {'does not resume' if again else 'resumes'} from {ckpt}:\n{err}")
                self.checkpoint_dirs.add(ckpt)
        return out + err  # what a terminal shows: the status lines (stderr) with the summary

    def assert_trained(self, out: str, cmd: Command) -> None:
        trained = "nothing to train" not in out and re.search(r"^trained \d+ steps", out, re.M)
        assert trained, self.said(f"{cmd.where}: this command did not train (its output above)")
        self.trained += 1

    def python(self, argv: list[str]) -> str:
        self.capsys.readouterr()
        if argv[0] == "-c":
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            self.monkeypatch.setattr(sys, "argv", argv)
            runpy.run_path(argv[0], run_name="__main__")
        out = self.capsys.readouterr().out
        self.transcript.append(out[-1500:])
        return out

    def python_block(self, text: str, where: str) -> None:
        """A Python block as a notebook or script runs it, in this process, its runs shortened."""
        import matplotlib

        from rayzero import Result

        matplotlib.use("Agg")  # result.plot() headless
        code, n = re.subn(r'("steps": |train\.steps=)(\d+)', lambda m: f"{m[1]}{shortened(int(m[2]))}", text)
        assert n or ".fit()" not in text, f"{where}: a run the test cannot shorten"
        self.transcript.append(f"{where}: >>> {text}")
        self.capsys.readouterr()
        started = time.monotonic()
        scope = {"__name__": "__main__"}
        exec(compile(code, f"{where}, the block", "exec"), scope)
        results = [v for v in scope.values() if isinstance(v, Result)]
        assert len(results) == text.count(".fit()"), f"{where}: a fit() whose result is not kept"
        for result in results:
            assert result.summary["steps"] > 0, f"{where}: nothing to train: {result.summary['checkpoint']}"
            self.trained += 1
            if result.config.model.kind == "module":  # a class defined in the block, as in a notebook cell
                module, name = result.config.model.factory.split(":")
                assert module == "__main__" and name in scope, result.config.model.factory
                own = scope[name](**result.config.model.kwargs)
                assert result.summary["num_params"] == sum(p.numel() for p in own.parameters())
                assert result.metrics["final_loss"] < result.metrics["first_loss"]
        import matplotlib.pyplot as plt

        plt.close("all")
        self.seconds.append((time.monotonic() - started, f"{where}: the Python block"))

    def shell(self, text: str, cmd: Command) -> str:
        """A command that is not rayzero's or Python's (`ray job ...`), in a shell, for real."""
        submit = cmd.starts_with("ray job submit")
        release_ranks()  # the head's CPUs are the job's
        steps = shortened(100)
        if submit:  # the entry point after `--` is rayzero train: shortened as the others
            text += f" train.steps={steps} tracking.enabled=false --no-progress"
        deadline = time.monotonic() + 60
        while True:
            r = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=600, cwd=self.clone)
            # A head just started takes a moment to have a job agent: Ray asks to try again later.
            if not (submit and "No available agent to submit job" in r.stderr and time.monotonic() < deadline):
                break
            time.sleep(1)
        out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
        self.transcript.append(out[-3000:])
        assert r.returncode == 0, self.said(f"{cmd.where}: exit code {r.returncode}")
        if submit:
            # The job's log streams back to the submitter; its checkpoint is committed where it said.
            self.job = job_id(out)
            self.assert_trained(out, cmd)
            assert f"trained {steps} steps" in out
            (checkpoint,) = re.findall(r"^ *checkpoint (\S+)$", out, re.M)
            assert checkpoint.endswith(f"step-{steps:06d}") and Path(checkpoint, "manifest.json").is_file(), checkpoint
            assert leftovers(self.ray_head.address) == ([], [])
        elif cmd.starts_with("ray job status"):
            assert f"Job '{self.job}' succeeded" in out, out
        elif cmd.starts_with("ray job logs"):
            assert f"trained {steps} steps" in out, out
            said = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("rayzero: [")
                    and not line.split("] ", 1)[1].startswith(" ")]  # the stages' lines, not those under them
            # start-up lines: the job's driver joined its cluster and placed the ranks beside its checks
            assert [line.split(" (begun at ")[0] for line in said[1:3]] == [
                "joining the Ray cluster this machine is part of",
                "placing 2 ranks (1 CPU each) and starting their processes"], out
            assert said[1].endswith("beside the checks)") and said[2].endswith("as Ray came up)"), out
        return out


def test_every_page_s_examples_run_in_order_in_a_fresh_clone(tmp_path, ray_head, s3_server, capsys, monkeypatch,
                                                             caplog):
    walk = Walk(ray_head, s3_server, capsys, monkeypatch, caplog)
    if not CRDS.is_dir():
        warnings.warn(f"{CRDS} is absent: `rayzero deploy check` runs without KubeRay's schema")
    walked = []
    try:
        for i, page in enumerate(pages()):
            if blocks(page):
                walk.page(page, clone_of_the_repository(tmp_path / f"{i:02d}-{Path(page).stem}"))
                walked.append(page)
    finally:  # the Python blocks' kept ranks, and this process's connection to the head, end with the walk
        release_ranks()
    print("".join(f"{s:6.1f} s  {what[:110]}\n" for s, what in walk.seconds))  # shown with -rP
    assert {"README.md", "docs/getting-started.md", "docs/guides/ray-cluster.md"} <= set(walked), walked
    assert walk.trained >= 15, "\n".join(walk.transcript)
    stale = (set(SKIPPED) | set(REPLACED) | set(walk.substitutions)) - walk.used
    assert not stale, f"no page's command has these any more: {sorted(stale)}"
