"""How a benchmark's result is written: one JSON file, stamped with where and on what it was measured
(the commit, ``+dirty`` where tracked files differ from it; the device; torch's and transformers'
versions), so that a figure can be read beside the code and the machine that made it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    """The commit of this checkout, the device (the GPU's name, else ``cpu``), torch's and transformers'
    versions."""
    root = Path(__file__).resolve().parents[2]
    commit = "unknown"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            commit = head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    out: dict[str, Any] = {"commit": commit}
    try:
        import torch

        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        out["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        out["device"], out["torch"] = "unknown", "missing"
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        out["transformers"] = "missing"
    return out


def write_json(result: dict[str, Any], path: Path) -> Path:
    """``result`` with its :func:`provenance` (under ``provenance``) to ``path``; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "provenance": provenance()}, indent=1, default=str))
    return path
