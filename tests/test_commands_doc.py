"""docs/commands.md names every command and every option the command line has.

The independent source is the parser itself (``fedsweep.cli.build_parser``): every sub-command it
registers, at every depth, and every long option of each, must stand in the commands page, so a new
flag cannot ship without its line there.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from fedsweep.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "commands.md"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, its long options) for the parser and every sub-command below it."""
    options = sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help")
    yield path, options
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


def _rows(doc: str) -> dict[str, str]:
    """Each table row of the page by the command it starts with (``fedsweep bench run``), all its rows'
    text together."""
    rows: dict[str, str] = {}
    for line in doc.splitlines():
        m = re.match(r"\| `fedsweep ((?:[a-z-]+ ?)+)", line)
        if m:
            key = m.group(1).strip()
            rows[key] = rows.get(key, "") + line
    return rows


def test_every_command_and_option_of_the_parser_is_on_the_commands_page():
    doc = DOC.read_text()
    rows = _rows(doc)
    missing = []
    for path, options in _commands(build_parser()):
        if not path:
            missing += [f"fedsweep {o}" for o in options if o not in doc]
            continue
        name = " ".join(path)
        own = " ".join(text for key, text in rows.items() if key == name or key.startswith(name + " "))
        if not own and f"fedsweep {name}" not in doc and f"`{path[-1]}" not in doc:
            missing.append(f"fedsweep {name} (the command)")
            continue
        missing += [f"fedsweep {name} {o}" for o in options if o not in (own or doc)]
    assert not missing, "not on docs/commands.md: " + ", ".join(missing)


def test_the_check_finds_an_option_the_page_does_not_name():
    """The check above fails where a row lacks an option (so it can fail)."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers().add_parser("bench").add_subparsers().add_parser("run")
    sub.add_argument("--out")
    sub.add_argument("--new-flag")
    rows = _rows("| `fedsweep bench run CONFIG [--out DIR]` | one experiment |")
    (_, top), (_, bench), (path, options) = list(_commands(parser))
    assert path == ("bench", "run") and options == ["--new-flag", "--out"]
    assert [o for o in options if o not in rows["bench run"]] == ["--new-flag"]
