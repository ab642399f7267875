"""The benchmarks page's tables and figures, drawn from the stored results.

    python benchmarks/figures.py           # (re)write docs/concepts/benchmarks.md's tables and
                                           # docs/assets/benchmarks/*.svg from benchmarks/results/
    python benchmarks/figures.py --check   # exit 1, naming what differs, if they are not what the results draw

Each `benchmarks/results/NAME.json` is what `benchmarks/record.py NAME -- SCRIPT ...` kept: the
script's own results, the command that reproduces them, the date, the commit, the hardware and
the versions. Each section of the page is a block between `<!-- results: NAME -->` and
`<!-- /results: NAME -->`, written here from NAME's file and nothing else; tests/unit/test_docs.py
checks that the page and its images are what the stored results draw.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from page_sections import BLOCKS, glance_block  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPTS_PAGE = ROOT / "docs" / "contributing" / "benchmark-notes.md"  # the scripts, from their docstrings
TOOLS = ("figures.py", "page_sections.py", "record.py")  # what records and draws, said on the page itself
PAGE = ROOT / "docs" / "concepts" / "benchmarks.md"
ASSETS = ROOT / "docs" / "assets" / "benchmarks"

# The same bytes from the same results: no date or version in the file, ids from a fixed salt,
# text kept as text (no font's glyphs drawn into it).
STYLE = {"svg.hashsalt": "rayzero", "svg.fonttype": "none", "font.family": "DejaVu Sans", "font.size": 9,
         "axes.spines.top": False, "axes.spines.right": False, "figure.dpi": 100}


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


DRAWN_BY = "<!-- drawn by benchmarks/figures.py with matplotlib {} -->"


def svg(fig) -> bytes:
    """The figure as SVG, saying which matplotlib drew it (another version draws the same figure
    in other bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    head, rest = buf.getvalue().decode().split("\n", 1)
    return f"{head}\n{DRAWN_BY.format(matplotlib.__version__)}\n{rest}".encode()


def _words(data: bytes) -> list[str]:
    """Every text the figure shows (its labels, ticks and values), as SVG keeps them."""
    return re.findall(r"<text[^>]*>(.*?)</text>", data.decode(), re.S)


def same_figure(kept: bytes, drawn: bytes) -> bool:
    """The same bytes, where the same matplotlib drew both; else the same texts (every number on it)."""
    version = re.search(r"with matplotlib (\S+) -->", kept.decode(errors="replace"))
    if version and version.group(1) == matplotlib.__version__:
        return kept == drawn
    return _words(kept) == _words(drawn) and bool(_words(drawn))


def draw() -> tuple[dict[str, str], dict[str, bytes]]:
    """Every block's markdown and every figure's SVG, from the stored results."""
    texts, images = {}, {}
    with plt.rc_context(STYLE):
        results = {name: load(name) for name in BLOCKS if (RESULTS / f"{name}.json").is_file()}
        texts["glance"] = glance_block(results)[0]
        for name, block in BLOCKS.items():
            if name not in results:
                continue
            text, figs = block(results[name])
            texts[name] = text
            images.update({f: svg(fig) for f, fig in figs.items()})
    return texts, images


def scripts_block() -> str:
    """Each benchmark script with its usage line(s) and the first paragraph of its docstring:
    what it measures, as the script itself says."""
    lines = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        usage = [line.strip() for line in doc.splitlines() if line.strip().startswith("python benchmarks/")]
        if path.name in TOOLS or not usage:
            continue
        first = " ".join(doc.split("\n\n", 1)[0].split())
        lines.append(f"- {' / '.join(f'`{u}`' for u in usage)}: {first}")
    return "\n".join(lines)


def _pages(texts: dict[str, str]) -> dict[Path, dict[str, str]]:
    """The blocks to write, by page."""
    return {PAGE: texts, SCRIPTS_PAGE: {"scripts": scripts_block()}}


def _marked(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- results: {name} -->\n)(.*?)(<!-- /results: {name} -->)", re.S)


def differences() -> list[str]:
    """What on the page or among its images is not what the stored results draw."""
    texts, images = draw()
    wrong = []
    for path, blocks in _pages(texts).items():
        page = path.read_text()
        for name, text in blocks.items():
            found = _marked(name).search(page)
            if found is None or found.group(2) != text + "\n":
                wrong.append(f"{path.relative_to(ROOT)}: the {name} block")
    for f, data in images.items():
        path = ASSETS / f"{f}.svg"
        if not path.is_file() or not same_figure(path.read_bytes(), data):
            wrong.append(str(path.relative_to(ROOT)))
    return wrong


def write() -> None:
    texts, images = draw()
    for path, blocks in _pages(texts).items():
        page = path.read_text()
        for name, text in blocks.items():
            if not _marked(name).search(page):
                raise SystemExit(f"{path.relative_to(ROOT)} has no block for {name}: add "
                                 f"<!-- results: {name} --> and <!-- /results: {name} -->")
            page = _marked(name).sub(lambda m: m.group(1) + text + "\n" + m.group(3), page)
        path.write_text(page)
    ASSETS.mkdir(parents=True, exist_ok=True)
    for f, data in images.items():
        (ASSETS / f"{f}.svg").write_bytes(data)
    print(f"wrote {PAGE.relative_to(ROOT)} and {len(images)} figures in {ASSETS.relative_to(ROOT)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say what differs")
    if ap.parse_args().check:
        wrong = differences()
        print("\n".join(wrong) or "the page and its figures are what the results draw")
        return int(bool(wrong))
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
