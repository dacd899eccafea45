"""How a benchmark's result is written: one JSON file, stamped with where and on what it was measured
(the commit, ``+dirty`` where tracked files differ from it; the device; torch's and transformers'
versions; the machine: CPU model, CPUs, torch's kernel level and threads), so that a figure can be read beside the code and the machine that made it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    """The commit of this checkout, the device (the GPU's name, else ``cpu``), torch's and transformers'
    versions, and :func:`fedsweep.machine.machine`."""
    from fedsweep.provenance import git_commit

    commit = git_commit(Path(__file__).resolve().parents[2])
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
    from fedsweep.machine import machine

    out["machine"] = machine()
    return out


def write_json(result: dict[str, Any], path: Path) -> Path:
    """``result`` with its :func:`provenance` (under ``provenance``) to ``path``; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "provenance": provenance()}, indent=1, default=str))
    return path
