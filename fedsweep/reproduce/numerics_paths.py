"""The code a card's numbers go through: what ``fedsweep reproduce --list`` watches for changes.

A report is stale when code that computes any value it tested changed after the commit it ran at. That
code is found, not listed: the files under ``fedsweep/`` that a trial's entry points reach by their
imports (every ``import`` statement, those inside functions included, read from the source), plus the
modules of the methods the card's study runs and what *they* import. Three rules shape it:

- ``fedsweep/algorithms/__init__.py`` imports every method to register it; a card depends on the
  methods it runs, not on the others, so that file is not followed (and moves no number itself);
- a package reached brings its directory's C sources too (the kernels beside
  ``fedsweep/kernels/__init__.py``, compiled on first use);
- :data:`NOT_NUMERICS` names what is reached but moves no tested value: command-line fronts, the
  bench, the GPU memory planner, and the reports' own verdict and figure code (``--verify`` recomputes
  verdicts with today's code from the CSV, so a change there shows up as a mismatch, not as staleness).

Until 2026-11-28 the watched code was a fixed list (engine, models, federation, data and the method's
own module), which missed the run's random streams (``salts.py``), the DRIFT kernels, the actors that
call the engine, the config's defaults and the methods' shared helpers.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ENTRY_POINTS = ("fedsweep/orchestrator/runner.py", "fedsweep/orchestrator/study.py",
                "fedsweep/reproduce/card_run.py")
"""Where a card's trials start: the runner (one trial), the Tune study around it, and the card's own
expansion of its budget into trials."""

PLUGIN_INDEX = "fedsweep/algorithms/__init__.py"
"""Imports every method (to register it): not followed."""

NOT_NUMERICS = (
    "fedsweep/cli",
    "fedsweep/bench",
    "fedsweep/orchestrator/terminal.py",
    "fedsweep/orchestrator/study_view.py",
    "fedsweep/orchestrator/tracking/ui.py",
    "fedsweep/reproduce/card_report.py",
    "fedsweep/reproduce/card_figure.py",
    "fedsweep/reports/figures.py",
    "fedsweep/reproduce/numerics_paths.py",
    "fedsweep/reproduce/pilot.py",
    "fedsweep/reproduce/fingerprint.py",
    "fedsweep/reproduce/bitwise.py",
    "fedsweep/reports/question.py",
    "fedsweep/reports/significance.py",
    "fedsweep/reports/verdicts.py",
    "fedsweep/models/memory.py",
    "fedsweep/plan/memory.py",
    "fedsweep/errors.py",
    "fedsweep/machine.py",
    "fedsweep/orchestrator/runtime/local_node.py",
    "fedsweep/orchestrator/runtime/fork_server.py",
    "fedsweep/orchestrator/runtime/worker_start.py",
)
"""Reached from the entry points but moving no tested value (see the module's docstring); the GPU
memory planner (``models/memory.py``, ``plan/memory.py``) is consulted only on a GPU, to size an actor's groups; a card
run's fingerprint (``fingerprint.py`` and the ``bitwise.py`` it reads checkpoints with) runs after its
study and computes nothing the study tested; ``machine.py`` records the
machine beside a report or a benchmark; ``local_node.py``, ``fork_server.py`` and its starter
``worker_start.py`` decide which of Ray's processes start and how (a forked worker computes what a fresh
one does: ``tests/test_fork_server.py`` compares a run's checkpoints with and without). An excluded
module's own imports are still followed."""

SOURCE_SUFFIXES = (".c", ".h")
"""Non-Python files a reached package's directory brings with it."""


def _module_file(module: str, root: Path) -> Path | None:
    rel = Path(*module.split("."))
    for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(path: Path, root: Path) -> set[str]:
    """Every ``fedsweep`` module ``path`` names in an import statement (``from a import b`` counts ``a``
    and, where it is a module, ``a.b``), with each module's parent packages."""
    package = path.relative_to(root).parent.parts  # what a relative import starts from
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    out = set()
    for module in found:
        if module == "fedsweep" or module.startswith("fedsweep."):
            parts = module.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def _excluded(rel: str) -> bool:
    return any(rel == p or rel.startswith(p + "/") for p in NOT_NUMERICS)


def reached(starts: tuple[str, ...], root: Path) -> set[str]:
    """Repository-relative files under ``fedsweep/`` reached from ``starts`` by imports, with the
    non-Python sources of each reached package's directory; :data:`PLUGIN_INDEX` is not followed."""
    seen: set[str] = set()
    todo = [root / s for s in starts]
    while todo:
        path = todo.pop()
        rel = path.relative_to(root).as_posix()
        if rel in seen:
            continue
        seen.add(rel)
        if path.name == "__init__.py":
            seen.update(p.relative_to(root).as_posix() for p in path.parent.iterdir()
                        if p.is_file() and p.suffix in SOURCE_SUFFIXES)
        if rel == PLUGIN_INDEX:
            continue
        for module in _imported_modules(path, root):
            target = _module_file(module, root)
            if target is not None:
                todo.append(target)
    return seen


@lru_cache(maxsize=64)
def _watched(methods: tuple[str, ...], root: str) -> tuple[str, ...]:
    base = Path(root)
    starts = list(ENTRY_POINTS)
    for name in methods:
        for candidate in (f"fedsweep/algorithms/{name}.py", f"fedsweep/algorithms/{name}/__init__.py"):
            if (base / candidate).is_file():
                starts.append(candidate)
    files = reached(tuple(s for s in starts if (base / s).is_file()), base)
    for name in methods:  # a method package's files all belong to it, imported or not
        package = base / "fedsweep/algorithms" / name
        if package.is_dir():
            files.update(p.relative_to(base).as_posix() for p in package.rglob("*")
                         if p.is_file() and "__pycache__" not in p.parts)
    files.discard(PLUGIN_INDEX)
    return tuple(sorted(f for f in files if not _excluded(f)))


def watched_files(methods: list[str], root: Path | None = None) -> list[str]:
    """The files a card running ``methods`` depends on (see the module's docstring), sorted."""
    return list(_watched(tuple(sorted(set(methods))), str((root or Path.cwd()).resolve())))


def code_units(text: str) -> frozenset[str] | None:
    """What a Python file computes, as the set of its top-level statements (definitions, assignments,
    calls) with import statements and docstrings left out: a file moved to another package, or a
    definition moved to another file, changes imports and the paths its docstrings name, not what
    it computes (what an import brings in is watched in its own file). None where it does not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        kept = [n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))]
        if kept and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and isinstance(kept[0], ast.Expr) and isinstance(getattr(kept[0], "value", None), ast.Constant) \
                and isinstance(kept[0].value.value, str):
            kept = kept[1:]
        node.body = kept or [ast.Pass()]
    return frozenset(ast.dump(n, include_attributes=False) for n in tree.body
                     if not (isinstance(n, ast.Expr) and isinstance(getattr(n, "value", None), ast.Constant)
                             and n.value.value == "__future__"))


def _git(args: list[str], root: Path, stdin: bytes | None = None) -> bytes | None:
    import subprocess

    try:
        done = subprocess.run(["git", *args], cwd=str(root), input=stdin, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@lru_cache(maxsize=16)
def _code_at(commit: str, root: str) -> tuple[dict[str, bytes], frozenset[bytes], frozenset[str]] | None:
    """At ``commit``: every file under ``fedsweep/`` by path, their contents, and every top-level statement
    of its Python files (:func:`code_units`). None where the commit is not in this checkout."""
    base = Path(root)
    listing = _git(["ls-tree", "-r", "-z", commit, "--", "fedsweep"], base)
    if listing is None:
        return None
    entries = [e.split("\t", 1) for e in listing.decode().split("\0") if e]
    blobs = [(meta.split()[2], path) for meta, path in entries if meta.split()[1] == "blob"]
    raw = _git(["cat-file", "--batch"], base, "".join(f"{sha}\n" for sha, _ in blobs).encode()) if blobs else b""
    if raw is None:
        return None
    files, at = {}, 0
    for _, path in blobs:  # each answer: "<sha> blob <size>\n<bytes>\n"
        header_end = raw.index(b"\n", at)
        size = int(raw[at:header_end].split()[2])
        files[path] = raw[header_end + 1:header_end + 1 + size]
        at = header_end + 1 + size + 1
    units: set[str] = set()
    for path, text in files.items():
        if path.endswith(".py"):
            units |= code_units(text.decode(errors="replace")) or set()
    return files, frozenset(files.values()), frozenset(units)


def _files_of(paths: list[str], base: Path) -> list[str]:
    """``paths`` with each folder among them replaced by the files below it (caches left out)."""
    out = []
    for rel in paths:
        path = base / rel
        if path.is_dir():
            out += sorted(p.relative_to(base).as_posix() for p in path.rglob("*")
                          if p.is_file() and "__pycache__" not in p.parts)
        else:
            out.append(rel)
    return out


def changed_code(commit: str, paths: list[str], root: Path | None = None) -> list[str] | None:
    """Which of ``paths`` (files under ``fedsweep/``) compute something that was not at ``commit``: a
    file is unchanged where the commit held the same bytes (at its path or any other: a move) or, for
    Python, where every one of its top-level statements is one the commit's files held
    (:func:`code_units`: moved files and definitions are followed by their code). None where the
    commit is unknown here."""
    base = Path(root or Path.cwd()).resolve()
    then = _code_at(commit, str(base))
    if then is None:
        return None
    files, contents, units = then
    changed = []
    for rel in _files_of(paths, base):
        path = base / rel
        now = path.read_bytes() if path.is_file() else None
        if now is not None and (files.get(rel) == now or now in contents):
            continue
        mine = code_units(now.decode(errors="replace")) if now is not None and rel.endswith(".py") else None
        if mine is not None and mine <= units:
            continue
        changed.append(rel)
    return changed
