"""Training records and their loaders.

A record is a plain dict so it travels to actors without pickling custom classes:

* instruction: ``{"prompt": str, "response": str, "task"?: str, "meta"?: dict}``
* preference:  ``{"prompt": str, "chosen": str, "rejected": str, "task"?: str, "meta"?: dict}``
* classification: ``{"prompt": str, "label": str, "task"?: str}`` (``label`` one of ``data.labels``)

``task`` names the domain (used by the partitioners and the scorer); ``meta`` carries
what the task's scorer needs (for reasoning-gym, the original entry).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from fedsweep.errors import DataError

Record = dict[str, Any]

REQUIRED = {"instruction": ("prompt", "response"), "preference": ("prompt", "chosen", "rejected"),
            "classification": ("prompt", "label")}


def map_columns(rec: dict, columns: dict[str, str | list[str]], where: str) -> dict:
    """A dataset row in the record layout: ``columns`` maps a record field (prompt, response,
    chosen, rejected, task) to the row's column, or to several columns joined by a blank line
    (Dolly's ``[instruction, context]``; empty ones are skipped). Unmapped fields keep their name."""
    out = dict(rec)
    for field_name, source in columns.items():
        names = [source] if isinstance(source, str) else list(source)
        missing = [n for n in names if n not in rec]
        if missing:
            raise DataError(f"{where}: data.columns.{field_name} names {missing[0]!r}, not a column "
                            f"(columns: {', '.join(sorted(map(str, rec)))})")
        parts = [rec[n] for n in names]
        if len(parts) == 1:
            out[field_name] = parts[0]
        else:
            out[field_name] = "\n\n".join(str(p) for p in parts if p not in (None, ""))
    return out


def check_record(rec: Any, kind: str, where: str, columns: dict | None = None) -> Record:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if columns:
        rec = map_columns(rec, columns, where)
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


MAX_RECORD_BYTES = 1 << 20
"""Default longest accepted JSONL line (``data.max_record_bytes``)."""
MAX_DEPTH = 32
"""Deepest accepted nesting of a record (objects and arrays)."""


def _depth(value: Any) -> int:
    """Nesting depth of JSON data, iteratively (no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def load_jsonl(path: str | Path, kind: str = "instruction", max_record_bytes: int = MAX_RECORD_BYTES,
               columns: dict | None = None) -> list[Record]:
    """Read a JSONL file of records; a bad line fails naming the file and the line number: not
    UTF-8, not JSON, longer than ``max_record_bytes``, nested deeper than ``MAX_DEPTH``, or
    missing a field."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    records = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            if len(raw) > max_record_bytes:
                raise DataError(f"{where}: record of {len(raw):,} bytes is over data.max_record_bytes = "
                                f"{max_record_bytes:,}")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON: {exc.msg}") from None
            except RecursionError:
                raise DataError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
            if _depth(rec) > MAX_DEPTH:
                raise DataError(f"{where}: nested deeper than {MAX_DEPTH} levels")
            records.append(check_record(rec, kind, where, columns))
    if not records:
        raise DataError(f"{path}: no records")
    return records


def load_hf(name: str, split: str = "train", kind: str = "instruction", columns: dict | None = None) -> list[Record]:
    """Load records from an HF dataset: a directory saved with ``save_to_disk`` or a dataset id."""
    import datasets

    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(name, split=split)
    return [check_record(dict(row), kind, f"{name}[{split}] row {i}", columns) for i, row in enumerate(ds)]


def write_jsonl(records: Iterable[Record], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
