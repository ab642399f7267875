"""The command-line reference, generated from the `rayzero` command's own parser.

    python -m rayzero.cli_reference            # (re)write docs/reference/cli.md
    python -m rayzero.cli_reference --check    # exit 1 if it is out of date

Every command, its usage, description and arguments (with their defaults and choices) come from
`rayzero.jobs.commands`' parser, the one `rayzero` runs, so the page cannot drift from what the
command accepts.
"""

from __future__ import annotations

import argparse
import sys

from rayzero.config_reference import page_command
from rayzero.jobs.commands import _parser

DEFAULT_PATH = "docs/reference/cli.md"
REGENERATE = "python -m rayzero.cli_reference"
NOTE = f"<!-- Generated from the command's parser by `{REGENERATE}`; do not edit by hand. -->"
INTRO = (
    "`rayzero COMMAND …`, installed with the package (`.venv/bin/rayzero`). A mistake in the "
    "arguments or the config exits 2 with one line, `rayzero: error: …`, on stderr; a run that "
    "fails exits 1, Ctrl-C 130 and SIGTERM 143. `rayzero COMMAND --help` prints what this page "
    "says of it. The keys `rayzero train` takes: the [configuration reference](configuration.md)."
)


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command that runs something, depth first in the parser's order: (its words, its
    parser, its one-line help)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    out += commands(sub, (*words, name))
                else:
                    out.append(((*words, name), sub, helps.get(name, "")))
    return out


def render() -> str:
    root = _parser()
    cmds = commands(root)
    parts = ["# Command-line reference", "", NOTE, "", INTRO, ""]
    parts += ["| command | what it does |", "| --- | --- |"]
    parts += [f"| [`rayzero {' '.join(w)}`](#{'-'.join(('rayzero', *w))}) | {_cell(h)} |" for w, _, h in cmds]
    parts.append("")
    for words, sub, _ in cmds:
        parts += [f"## rayzero {' '.join(words)}", ""]
        usage = " ".join(sub.format_usage().split())
        parts += ["```text", usage.removeprefix("usage: "), "```", ""]
        if sub.description:
            parts += [" ".join(sub.description.split()), ""]
        rows = [_row(a) for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        if rows:
            parts += ["| argument | default | meaning |", "| --- | --- | --- |", *rows, ""]
        if sub.epilog:
            parts += ["```text", sub.epilog.strip("\n"), "```", ""]
    return "\n".join(parts)


def _row(a: argparse.Action) -> str:
    name = ", ".join(a.option_strings) if a.option_strings else (a.metavar or a.dest)
    if a.option_strings and a.nargs != 0:
        name += f" {a.metavar or a.dest.upper()}"
    if a.nargs in ("*", "+") and not a.option_strings:
        name += " …"
    default = ""
    if a.nargs != 0 and a.default not in (None, argparse.SUPPRESS) and a.default != []:
        default = f"`{a.default}`"
    meaning = " ".join((a.help or "").split())
    if a.choices:
        meaning += (" " if meaning else "") + "One of " + ", ".join(f"`{c}`" for c in a.choices) + "."
    return f"| `{name}` | {default} | {_cell(meaning)} |"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    return page_command(argv, "rayzero.cli_reference", "the command-line reference generated from the parser",
                        DEFAULT_PATH, render)


if __name__ == "__main__":
    sys.exit(main())
