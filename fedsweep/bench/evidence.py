"""The evidence behind the docs, kept in git's history rather than in the tree.

A measurement lands as its JSON (and logs, and the command that made them) under
``benchmarks/raw/<date>-<machine>-<what>/``. Once the docs cite it, ``fedsweep bench archive FOLDER``
lists each of its files in ``benchmarks/manifest.json`` — its path, the commit that holds it, its
SHA-256 — and removes the folder from the tree: main's history is the archive, and nothing is lost.
``git show COMMIT:PATH`` (or :func:`read_back`) brings a file back; :func:`verify` checks that every
listed file still reads back from git with its digest, and :func:`uncited` that every
``benchmarks/raw/…`` path a document names is in the tree or in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

MANIFEST = Path("benchmarks") / "manifest.json"
RAW = "benchmarks/raw/"
CITED = re.compile(r"benchmarks/raw/[A-Za-z0-9_./-]*[A-Za-z0-9_/-]")
"""A ``benchmarks/raw/…`` path as documents write it (a folder or a file)."""
CITING = ("*.md", "*.py", "*.yaml", "*.sh", "Makefile")
"""The tracked files whose mentions of ``benchmarks/raw/…`` must resolve."""


def _git(args: list[str], root: Path, data: bytes | None = None) -> bytes | None:
    done = subprocess.run(["git", *args], cwd=root, input=data, capture_output=True)
    return done.stdout if done.returncode == 0 else None


def load(root: Path) -> dict:
    """The manifest (``{"files": [{"path", "commit", "sha256", "bytes"}]}``; empty where there is none)."""
    path = root / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"files": []}


def read_back(root: Path, commit: str, path: str) -> bytes | None:
    """The bytes of ``path`` at ``commit`` (None where this clone does not have them)."""
    return _git(["show", f"{commit}:{path}"], root)


def has_history(root: Path, commits: set[str]) -> bool:
    """Whether this clone holds every one of ``commits`` (a shallow clone or a tree without ``.git`` does not)."""
    return all(_git(["cat-file", "-e", f"{c}^{{commit}}"], root) is not None for c in commits)


def verify(root: Path) -> list[str]:
    """Every listed file that does not read back from git with its SHA-256 (each with why); [] when all do.
    One ``git cat-file --batch`` for all of them."""
    files = load(root)["files"]
    if not files:
        return []
    query = "".join(f"{f['commit']}:{f['path']}\n" for f in files).encode()
    out = _git(["cat-file", "--batch"], root, query)
    if out is None:
        return ["git cat-file --batch failed"]
    wrong, at = [], 0
    for f in files:
        end = out.index(b"\n", at)
        header = out[at:end].split()
        if len(header) < 3 or header[1] != b"blob":
            wrong.append(f"{f['path']}: not at {f['commit'][:10]}")
            at = end + 1
            continue
        size = int(header[2])
        blob = out[end + 1:end + 1 + size]
        at = end + 1 + size + 1
        if hashlib.sha256(blob).hexdigest() != f["sha256"]:
            wrong.append(f"{f['path']}: SHA-256 differs at {f['commit'][:10]}")
    return wrong


def tracked(root: Path, patterns: tuple[str, ...] = ("*",)) -> list[str]:
    """Tracked paths matching ``patterns`` (git pathspecs); [] outside a git checkout."""
    out = _git(["ls-files", "-z", "--", *patterns], root)
    return [p for p in out.decode().split("\0") if p] if out else []


def uncited(root: Path) -> list[str]:
    """``benchmarks/raw/…`` paths named in tracked documents and code (tests aside) that are neither in the tree nor in
    the manifest (a folder, or a glob's stem such as ``…/before*.json``, counts where some file under it
    or starting with it is): each as ``FILE: PATH``."""
    listed = {f["path"] for f in load(root)["files"]}
    present = set(tracked(root, (RAW,)))
    known = listed | present
    missing = []
    for doc in sorted(set(tracked(root, CITING))):
        if doc.startswith((RAW, "tests/")):  # (tests name made-up folders)
            continue
        for path in set(CITED.findall((root / doc).read_text(errors="replace"))):
            path = path.rstrip("/.")
            if path + "/" == RAW or any(k.startswith(path) for k in known):  # (a folder, or a glob's stem)
                continue
            missing.append(f"{doc}: {path}")
    return sorted(missing)


def archive(root: Path, folders: list[str]) -> list[dict]:
    """List every tracked file under ``folders`` (each ``benchmarks/raw/…``) in the manifest at the
    commit that holds it (HEAD; each must be committed unchanged), then remove them from the tree
    (``git rm``). Returns the entries added."""
    head = _git(["rev-parse", "HEAD"], root)
    if head is None:
        raise RuntimeError("not a git checkout: nothing to archive into")
    commit = head.decode().strip()
    manifest = load(root)
    have = {f["path"] for f in manifest["files"]}
    added = []
    for folder in folders:
        folder = folder.rstrip("/")
        if not folder.startswith(RAW):
            raise ValueError(f"{folder}: only folders under {RAW} are archived")
        files = tracked(root, (folder,))
        if not files:
            raise ValueError(f"{folder}: no tracked file under it")
        dirty = _git(["status", "--porcelain", "--", folder], root)
        if dirty:
            raise ValueError(f"{folder}: has uncommitted changes; commit them first")
        for path in files:
            blob = read_back(root, commit, path)
            if path in have or blob is None:
                continue
            added.append({"path": path, "commit": commit, "sha256": hashlib.sha256(blob).hexdigest(),
                          "bytes": len(blob)})
    manifest["files"] = sorted(manifest["files"] + added, key=lambda f: f["path"])
    manifest.setdefault("about", "Raw measurement files cited by the docs, kept in git's history: "
                                 "`git show COMMIT:PATH` brings one back (fedsweep.bench.evidence).")
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if added:
        _git(["rm", "-q", "-r", "--", *[f.rstrip("/") for f in folders]], root)
    return added


def measurement_bytes(root: Path) -> int:
    """Tracked bytes of measurement output under ``benchmarks/`` and ``reproductions/``: everything but
    scripts, a card's reports, CSVs and figures, the pages that read the measurements, and the manifest."""
    total = 0
    for path in tracked(root, ("benchmarks", "reproductions")):
        script = path.endswith((".py", ".sh"))
        card = path.startswith("reproductions/") and path.endswith((".md", ".csv", ".png"))
        page = path.count("/") == 1 and path.endswith(".md")  # benchmarks/README.md and the notebook
        if script or card or page or path == MANIFEST.as_posix():
            continue
        total += (root / path).stat().st_size
    return total
