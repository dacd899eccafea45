"""The reference pages name everything a user can set: docs/commands.md every command and option the
command line has, docs/configuration.md every field of an experiment's config.

The independent sources are the parser itself (``fedsweep.cli.build_parser``: every sub-command it
registers, at every depth, and every long option of each) and the config's schema
(``fedsweep.config.schema.ExperimentConfig``: every field, at every depth), each looked for in the row of
its own command or section, so a new flag or field cannot ship without its line there.
"""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pydantic

from fedsweep.cli import build_parser
from fedsweep.config.schema import ExperimentConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"

INTERNAL = {"hparams": "filled by validation from the sections named after methods (the page's *plugin name* row)"}
"""Config fields a user does not write, with the reason."""


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


def _undocumented_options(parser: argparse.ArgumentParser, doc: str) -> list[str]:
    """Every command of ``parser`` the page ``doc`` does not name, and every option its own rows do not."""
    rows = _rows(doc)
    missing = []
    for path, options in _commands(parser):
        if not path:
            missing += [f"fedsweep {o}" for o in options if o not in doc]
            continue
        name = " ".join(path)
        own = " ".join(text for key, text in rows.items() if key == name or key.startswith(name + " "))
        if not own and f"fedsweep {name}" not in doc and f"`{path[-1]}" not in doc:
            missing.append(f"fedsweep {name} (the command)")
            continue
        missing += [f"fedsweep {name} {o}" for o in options if o not in (own or doc)]
    return missing


def test_every_command_and_option_of_the_parser_is_on_the_commands_page():
    missing = _undocumented_options(build_parser(), (DOCS / "commands.md").read_text())
    assert not missing, "not on docs/commands.md: " + ", ".join(missing)


def test_the_check_finds_an_option_the_page_does_not_name():
    """The check above fails where a command's row lacks one of its options, even where another
    command's row names it, and where the page lacks a command (so it can fail)."""
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    sub = commands.add_parser("bench").add_subparsers().add_parser("run")
    sub.add_argument("--out")
    sub.add_argument("--new-flag")
    commands.add_parser("tune").add_argument("--new-flag")
    commands.add_parser("serve")
    doc = ("| `fedsweep bench run CONFIG [--out DIR]` | one experiment |\n"
           "| `fedsweep tune SWEEP [--new-flag]` | a study |")
    assert _undocumented_options(parser, doc) == ["fedsweep bench run --new-flag", "fedsweep serve (the command)"]


def _fields(model: type[pydantic.BaseModel], path: tuple[str, ...] = ()):
    """Every field's path in the schema, sub-sections' fields included."""
    for name, field in model.model_fields.items():
        yield path + (name,)
        for inner in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(inner, type) and issubclass(inner, pydantic.BaseModel):
                yield from _fields(inner, path + (name,))


def _sections(doc: str) -> dict[str, str]:
    """The section table's rows by section (``top level`` for the experiment's own fields)."""
    out = {}
    for line in doc.splitlines():
        m = re.match(r"\| (?:`([a-z_]+)`|(top level)) \|", line)
        if m:
            out[m.group(1) or m.group(2)] = line
    return out


def _undocumented(fields, rows: dict[str, str]) -> list[str]:
    missing = []
    for path in fields:
        if path[0] in INTERNAL:
            continue
        if len(path) == 1 and path[0] in rows:  # a section: its own row
            continue
        row = rows.get(path[0] if len(path) > 1 else "top level", "")
        if f"`{path[-1]}`" not in row:
            missing.append(".".join(path))
    return missing


def test_every_config_field_is_in_its_section_s_row_of_the_configuration_page():
    missing = _undocumented(_fields(ExperimentConfig), _sections((DOCS / "configuration.md").read_text()))
    assert not missing, "not on docs/configuration.md: " + ", ".join(missing)


def test_the_config_check_finds_a_field_named_only_in_another_section():
    rows = _sections("| top level | `name`, `seed` |\n| `server` | `deadline_s`, `robust` (`rule`) |\n"
                     "| `train` | `partial_sums` |")
    fields = [("name",), ("server",), ("eval",), ("server", "deadline_s"), ("server", "robust"), ("server", "robust", "rule"),
              ("server", "partial_sums"), ("hparams",)]
    assert _undocumented(fields, rows) == ["eval", "server.partial_sums"]


CLIENT_LEVEL = re.compile(r"wilcoxon|client × seed pairs|client-pair|client pairs|\(seed, client\) pairs", re.I)
"""A client-level test (clients of one run taken as independent): superseded from every card's version 2 on."""
MARKED = re.compile(r"supersed|history|earlier rules|\bv\d+\b|version \d|first version|old rule|description only|"
                    r"never tested", re.I)
"""What places such a result: superseded, history, the version it belongs to, or description only."""


def unmarked_client_level(text: str) -> list[str]:
    """The paragraphs of ``text`` (blank lines, or empty comment lines, apart) that present a client-level
    test without saying it is superseded, history, a named version's, or description only."""
    return [p.strip()[:160] for p in re.split(r"\n\s*\n|\n#\s*\n", text) if CLIENT_LEVEL.search(p) and not MARKED.search(p)]


def test_no_document_presents_a_client_level_test_as_a_current_finding():
    """Issue #94: the docs, README and the cards' headers mention the client-pair Wilcoxon test only as
    superseded (or as a named earlier version's, or description): a reader never takes it for a finding.
    The card reports themselves (``reproductions/``) are the record of their version and stay as written."""
    assert unmarked_client_level("FedICU beats FedAvg over 16 client × seed pairs (Wilcoxon, p 0.01).")
    assert not unmarked_client_level("v1 tested 16 client × seed pairs (Wilcoxon); superseded by the run as the unit.")
    files = [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md", *sorted((DOCS.parent / "configs" / "reproductions").glob("*.yaml"))]
    found = [f"{f.relative_to(DOCS.parent)}: {p}" for f in files for p in unmarked_client_level(f.read_text())]
    assert not found, "\n".join(found)
