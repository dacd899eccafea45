"""Where a result comes from: the commit of the checkout that made it (one rule for reports, cards and
benchmarks alike)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(root: Path | None = None) -> str:
    """The checkout's commit, with ``+dirty`` where tracked files differ from it; ``unknown`` outside git.
    ``root``: where to ask (default: the working directory)."""
    cwd = str(root or Path.cwd())
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
