"""The documentation: the site builds from `docs/` with no warning (no broken link, anchor or API
reference), its generated pages are in step with the code, the README stays a short start with
links that resolve, and the questions users ask most have a page whose heading answers them.
(Every example on the pages runs in tests/e2e/test_examples.py.)"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rayzero import cli_reference
from rayzero.jobs.commands import _parser

ROOT = Path(__file__).resolve().parents[2]

# A question a new user asks -> the page (in the site's navigation) and the heading on it that
# answers it: each found in one step, from the navigation or the search.
ONE_STEP = {
    "how to resume at another world size": ("guides/checkpoints.md", "Resuming at another world size"),
    "what parallel.pp_schedule accepts": ("reference/configuration.md", "parallel"),
    "how to load a PEFT adapter": ("guides/lora.md", "Loading a PEFT adapter"),
    "how to write to S3": ("guides/checkpoints.md", "In S3"),
}


@pytest.mark.slow
def test_the_site_builds_with_no_warning_and_its_search_finds_the_answers(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "WARNING" not in r.stderr, r.stderr[-3000:]
    # The search index has each answer as a section of its own, under its page.
    index = json.loads((site / "search" / "search_index.json").read_text())["docs"]
    titles = {(d["location"].split("#")[0], d["title"]) for d in index}
    for question, (page, heading) in ONE_STEP.items():
        location = page.removesuffix(".md") + "/"
        assert (location, heading) in titles, (question, sorted(t for t in titles if t[0] == location))
    # The Python API is rendered from the docstrings: every public name of `rayzero`, and fit().
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("TrainConfig", "Trainer", "Trainer.fit", "Result", "Result.generate", "release_ranks"):
        assert f'id="rayzero.sdk.{name}"' in api, name


def test_every_question_has_its_heading_on_a_page_of_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for question, (page, heading) in ONE_STEP.items():
        assert f": {page}" in nav, (question, page)
        assert re.search(rf"^#+ {re.escape(heading)}$", (ROOT / "docs" / page).read_text(), re.M), (question, heading)
    # what `parallel.pp_schedule` accepts: its row, with every schedule the config takes
    from typing import get_args

    from rayzero.config import RootConfig

    accepted = get_args(RootConfig.model_fields["parallel"].annotation.model_fields["pp_schedule"].annotation)
    row = next(line for line in (ROOT / "docs/reference/configuration.md").read_text().splitlines()
               if line.startswith("| `parallel.pp_schedule`"))
    assert accepted and all(f"`{s}`" in row for s in accepted), row


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []


def test_the_command_line_reference_is_up_to_date():
    path = ROOT / cli_reference.DEFAULT_PATH
    assert path.read_text() == cli_reference.render(), f"{cli_reference.DEFAULT_PATH} is out of date: run " \
                                                       f"{cli_reference.REGENERATE}"


def test_the_command_line_reference_has_every_command_and_flag():
    text = cli_reference.render()
    commands = cli_reference.commands(_parser())
    assert {" ".join(w) for w, _, _ in commands} == {"train", "data prepare", "generate", "ckpt ls", "ckpt verify",
                                                     "ckpt export", "deploy check", "tracking send"}
    for words, sub, _ in commands:
        section = text.split(f"## rayzero {' '.join(words)}\n", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in section, (words, flag)
            if action.choices and not action.option_strings:
                continue
            for choice in action.choices or ():
                assert f"`{choice}`" in section, (words, action.dest, choice)


def test_the_command_line_reference_check_says_how_to_renew_it(tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text("old")
    assert cli_reference.main(["--check", str(stale)]) == 1
    assert f"{stale} is out of date: run python -m rayzero.cli_reference {stale}" in capsys.readouterr().err
    assert cli_reference.main([str(stale)]) == 0 and cli_reference.main(["--check", str(stale)]) == 0


def test_the_readme_is_a_short_start_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 150
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 15 and [link for link in local if not (ROOT / link).exists()] == []
    # every guide is reachable from the README's list
    guides = {str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md")}
    assert guides - set(local) == set()


def test_the_pictures_are_the_ones_the_code_draws():
    from tests.pictures import pictures_block

    page = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    start, end = "<!-- pictures: python -m tests.pictures -->\n", "\n<!-- /pictures -->"
    said = page[page.index(start) + len(start):page.index(end)]
    assert said == pictures_block(), "docs/concepts/architecture.md: paste `python -m tests.pictures`"


def test_the_models_matrix_is_what_the_tests_run():
    from tests.matrix import matrix_block, tested_versions

    page = (ROOT / "docs" / "reference" / "models.md").read_text()
    start, end = "<!-- matrix: python -m tests.matrix -->\n", "\n<!-- /matrix -->"
    said = page[page.index(start) + len(start):page.index(end)]
    tables, _, versions = said.rpartition("\n")
    assert tables == matrix_block().rpartition("\n")[0], "docs/reference/models.md: paste `python -m tests.matrix`"
    # The versions line names what the page was last pasted with. A clean install may resolve a
    # newer release of an unpinned package: the same major, never an older one, still holds.
    installed = tested_versions()
    named = dict(re.findall(r"(Python|torch|Ray|transformers|PEFT|TRL) (\d+\.\d+)", versions))
    assert {k.lower() for k in named} == set(installed), versions
    for name, version in named.items():
        have, said_v = (tuple(map(int, v.split("."))) for v in (installed[name.lower()], version))
        assert have[0] == said_v[0] and have >= said_v, f"{name}: the page says {version}, the suite runs {installed[name.lower()]}"


def test_the_benchmarks_page_and_its_figures_are_what_the_stored_results_draw():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import figures
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert figures.differences() == [], "run python benchmarks/figures.py"
    # every image the page shows is one the results draw, and every result has its block
    page = figures.PAGE.read_text()
    shown = set(re.findall(r"\(\.\./assets/benchmarks/([^)]+)\.svg\)", page))
    texts, images = figures.draw()
    assert shown == set(images) and set(texts) == {"glance", *figures.BLOCKS}
    assert {p.stem for p in figures.RESULTS.glob("*.json")} >= set(figures.BLOCKS)
