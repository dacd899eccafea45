"""How a benchmark's result is written: one JSON file, stamped with where and on what it was measured
(the commit, ``+dirty`` where tracked files differ from it; the device; torch's and transformers'
versions; the machine: CPU model, CPUs, torch's CPU kernel level), so that a figure can be read beside
the code and the machine that made it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    """The commit of this checkout, the device (the GPU's name, else ``cpu``; read from
    :func:`fedsweep.machine.machine`, kept beside it under ``machine``), torch's and transformers'
    versions."""
    from fedsweep.machine import machine
    from fedsweep.provenance import git_commit

    record = machine()
    out: dict[str, Any] = {"commit": git_commit(Path(__file__).resolve().parents[2]),
                           "device": record["gpu"] or "cpu"}
    try:
        import torch

        out["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        out["torch"] = "missing"
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        out["transformers"] = "missing"
    out["machine"] = record
    return out


def write_json(result: dict[str, Any], path: Path) -> Path:
    """``result`` with its :func:`provenance` (under ``provenance``) to ``path``; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "provenance": provenance()}, indent=1, default=str))
    return path
