"""Where a result comes from: the commit of the checkout that made it (one rule for reports, cards and
benchmarks alike)."""

from __future__ import annotations

import subprocess
from pathlib import Path


FINGERPRINT_STORE = "fingerprints.json.gz"
"""A card's numerics fingerprints by commit, in ``reproductions/CARD/`` (``reproduce.fingerprint``)."""
WRITTEN_BY_RUNS = (f"reproductions/*/{FINGERPRINT_STORE}",)
"""Tracked files the project's own commands write as records (a card run adds its fingerprint after its
report): they leave a checkout's commit clean, so a card's replication run from the same clone after its
registered run records the commit, not ``+dirty``."""


def git_commit(root: Path | None = None) -> str:
    """The checkout's commit, with ``+dirty`` where tracked files other than :data:`WRITTEN_BY_RUNS` differ
    from it; ``unknown`` outside git. ``root``: where to ask (default: the working directory)."""
    cwd = str(root or Path.cwd())
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        records = [f":(top,glob,exclude){pattern}" for pattern in WRITTEN_BY_RUNS]
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)", *records],
                               cwd=cwd, capture_output=True, text=True, timeout=30).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
