"""Training records and their loaders.

A record is a plain dict so it travels to actors without pickling custom classes:

* instruction: ``{"prompt": str, "response": str, "task"?: str, "meta"?: dict}``
* preference:  ``{"prompt": str, "chosen": str, "rejected": str, "task"?: str, "meta"?: dict}``

``task`` names the domain (used by the partitioners and the scorer); ``meta`` carries
what the task's scorer needs (for reasoning-gym, the original entry).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

Record = dict[str, Any]

REQUIRED = {"instruction": ("prompt", "response"), "preference": ("prompt", "chosen", "rejected")}


class DataError(ValueError):
    """A bad data file or row, described in one line naming the file and line."""


def check_record(rec: Any, kind: str, where: str) -> Record:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for key in REQUIRED[kind]:
        value = rec.get(key)
        if value is None:
            raise DataError(f"{where}: missing field '{key}' (a {kind} record needs {', '.join(REQUIRED[kind])})")
        if not isinstance(value, str):
            raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if "task" in rec and not isinstance(rec["task"], str):
        raise DataError(f"{where}: field 'task' must be a string")
    out = {k: rec[k] for k in REQUIRED[kind]}
    out["task"] = rec.get("task", "default")
    if "meta" in rec:
        out["meta"] = rec["meta"]
    return out


def load_jsonl(path: str | Path, kind: str = "instruction") -> list[Record]:
    """Read a JSONL file of records; a bad line fails naming the file and the line number."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
            records.append(check_record(rec, kind, f"{path}:{lineno}"))
    if not records:
        raise DataError(f"{path}: no records")
    return records


def load_hf(name: str, split: str = "train", kind: str = "instruction") -> list[Record]:
    """Load records from an HF dataset: a directory saved with ``save_to_disk`` or a dataset id."""
    import datasets

    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(name, split=split)
    return [check_record(dict(row), kind, f"{name}[{split}] row {i}") for i, row in enumerate(ds)]


def write_jsonl(records: Iterable[Record], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
