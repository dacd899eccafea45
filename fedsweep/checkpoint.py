"""Atomic round checkpoints: safetensors for tensors, JSON for the rest, never pickle.

Layout under a run's checkpoint root::

    round_0003/            a complete round (renamed into place last)
        server.safetensors server.json
        client_00000.safetensors client_00000.json ...
        COMPLETE           written last inside the staging folder
    round_0004.partial/    staging folder of a round being written (ignored, removed)

A round folder is written under ``.partial``, every file fsynced, then renamed: a crash
leaves either the previous complete round or the new one, never a half-written one.
Before ``COMPLETE``, ``MANIFEST.json`` records every file's size and SHA-256; ``latest``
returns the newest round whose files match it, so a deleted, truncated or altered file is
never read as a default: resumption falls back to the newest intact round and says why.

The root may also be a URI of any filesystem pyarrow supports (``s3://…``, ``gs://…``,
``hdfs://…``, ``file:///…``; see ``fedsweep.storage``). Object stores cannot rename a
folder atomically, so there a round is written in place and sealed by its ``COMPLETE``
marker, written after every other file: a round without it is ignored and rewritten.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from fedsweep import tensor_file
from fedsweep.algorithms.tensors import Params, compact
from fedsweep.algorithms.types import ServerState
from fedsweep.lazy import torch
from fedsweep.storage import AnyPath, RemotePath, location, remove_tree
from fedsweep.tensor_file import Digest

ROUND_RE = re.compile(r"^round_(\d{4,})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(path: AnyPath, tensors: Params) -> Digest:
    """Write ``tensors`` as a safetensors file (fsynced); returns its size and SHA-256."""
    return write_chunks(path, tensor_chunks(tensors))


def write_json(path: AnyPath, data: Any) -> Digest:
    """Write ``data`` as JSON (fsynced); returns its size and SHA-256."""
    return write_chunks(path, [json_bytes(data)])


def tensor_chunks(tensors: Params) -> list[memoryview | bytes]:
    """A safetensors file's content, copied out of ``tensors`` now (what :func:`write_chunks` writes later)."""
    if not tensor_file.supported(tensors):  # a dtype the fast writer does not name: safetensors' own
        from safetensors.torch import save

        # (views of one storage, e.g. a client's row, each in its own: safetensors refuses shared memory)
        return [save(compact({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}))]
    return tensor_file.encode(tensors)


def json_bytes(data: Any) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode("utf-8")


def write_chunks(path: AnyPath, chunks: list[memoryview | bytes]) -> Digest:
    """Write the chunks of one file (fsynced, or put whole into an object store); returns its size and SHA-256."""
    if isinstance(path, RemotePath):
        data = b"".join(chunks)
        path.write_bytes(data)
        return tensor_file.digest_of(data)
    return tensor_file.write_chunks(path, chunks)


def read_tensors(path: AnyPath) -> Params:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    from safetensors.torch import load, load_file

    return load(path.read_bytes()) if isinstance(path, RemotePath) else load_file(str(path))


def read_json(path: AnyPath) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def nest(flat: Params, sep: str = "/") -> dict[str, Params]:
    """``{"a/x": t}`` -> ``{"a": {"x": t}}`` (first separator only)."""
    out: dict[str, Params] = {}
    for key, value in flat.items():
        head, _, tail = key.partition(sep)
        out.setdefault(head, {})[tail] = value
    return out


def flatten(groups: dict[str, Params], sep: str = "/") -> Params:
    return {f"{g}{sep}{k}": v for g, params in groups.items() for k, v in params.items()}


# ----------------------------------------------------------------------- server state


def server_state_tensors(state: ServerState) -> Params:
    groups: dict[str, Params] = {}
    if state.globals is not None:
        groups["globals"] = state.globals
    for cid, params in state.personal.items():
        groups[f"personal.{cid}"] = params
    for name, params in state.buffers.items():
        groups[f"buffer.{name}"] = params
    return flatten(groups)


def server_state_from(tensors: Params, meta: dict[str, Any]) -> ServerState:
    state = ServerState(meta=meta)
    for group, params in nest(tensors).items():
        if group == "globals":
            state.globals = params
        elif group.startswith("personal."):
            state.personal[int(group.split(".", 1)[1])] = params
        elif group.startswith("buffer."):
            state.buffers[group.split(".", 1)[1]] = params
    return state


# ------------------------------------------------------------------------- round dirs


def round_dir(root: AnyPath | str, rnd: int) -> AnyPath:
    return location(root) / f"round_{rnd:04d}"


def staging_dir(root: AnyPath | str, rnd: int) -> AnyPath:
    """The folder a round is written into: ``.partial`` locally, the round folder itself on a URI."""
    root = location(root)
    path = round_dir(root, rnd) if isinstance(root, RemotePath) else root / f"round_{rnd:04d}.partial"
    remove_tree(path)
    path.mkdir(parents=True)
    return path


MANIFEST = "MANIFEST.json"
SEALS = ("COMPLETE", MANIFEST)


def _digest(path: AnyPath) -> Digest:
    """Size and SHA-256 of a file as it is on disk (or in the store) now."""
    if isinstance(path, RemotePath):
        return tensor_file.digest_of(path.read_bytes())
    import hashlib

    h, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return Digest(size, h.hexdigest())


def write_manifest(folder: AnyPath, known: dict[str, dict] | None = None) -> dict[str, Any]:
    """``MANIFEST.json``: name, size and SHA-256 of every file of a staged round.

    ``known`` maps file names to the ``{"bytes", "sha256"}`` their writer computed from the bytes
    it wrote (:func:`write_tensors`, :func:`write_json`), or that the round a reused file came
    from recorded: those files are not read back. The others are hashed from the folder."""
    known = known or {}
    files = {}
    for child in sorted(folder.iterdir(), key=lambda p: p.name):
        if child.name in SEALS:
            continue
        if child.name in known:
            files[child.name] = dict(known[child.name])
            continue
        files[child.name] = _digest(child).as_json()
    manifest = {"files": files}
    write_json(folder / MANIFEST, manifest)
    return manifest


def manifest_entries(folder: AnyPath) -> dict[str, dict]:
    """The ``{"bytes", "sha256"}`` per file that ``folder``'s manifest records ({} if it has none)."""
    try:
        return dict(read_json(folder / MANIFEST)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def verify(folder: AnyPath) -> str | None:
    """Why the round in ``folder`` is not intact (missing manifest, a missing, resized or altered
    file), or None."""
    if not (folder / MANIFEST).exists():
        return f"{MANIFEST} missing"
    try:
        files = read_json(folder / MANIFEST)["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} unreadable"
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.exists():
            return f"{name} missing"
        got = _digest(path)
        if got.bytes != want["bytes"]:
            return f"{name} has {got.bytes} bytes, {want['bytes']} expected"
        if got.sha256 != want["sha256"]:
            return f"{name} does not match its SHA-256"
    return None


def latest_intact(root: AnyPath | str) -> tuple[AnyPath | None, list[str]]:
    """(the newest complete round whose files match its manifest, why each newer one was skipped)."""
    skipped = []
    for rnd in reversed(complete_rounds(root)):
        folder = round_dir(root, rnd)
        problem = verify(folder)
        if problem is None:
            return folder, skipped
        skipped.append(f"{folder.name}: {problem}")
    return None, skipped


def commit(root: AnyPath | str, rnd: int, keep: int, known: dict[str, dict] | None = None) -> AnyPath:
    """Seal the staged round and make it the latest; drop all but the newest ``keep``. ``known``:
    digests the writers computed (see :func:`write_manifest`)."""
    root = location(root)
    if isinstance(root, RemotePath):
        final = round_dir(root, rnd)
        write_manifest(final, known)
        write_json(final / "COMPLETE", {"round": rnd})  # last: seals the round
        for old in complete_rounds(root)[:-keep]:
            remove_tree(round_dir(root, old))
        return final
    stage, final = root / f"round_{rnd:04d}.partial", round_dir(root, rnd)
    write_manifest(stage, known)
    write_json(stage / "COMPLETE", {"round": rnd})
    _fsync_dir(stage)
    if final.exists():
        shutil.rmtree(final)
    os.replace(stage, final)
    _fsync_dir(root)
    for old in complete_rounds(root)[:-keep]:
        shutil.rmtree(round_dir(root, old), ignore_errors=True)
    return final


def complete_rounds(root: AnyPath | str) -> list[int]:
    root = location(root)
    if not root.is_dir():
        return []
    rounds = []
    for child in root.iterdir():
        m = ROUND_RE.match(child.name)
        if m and (child / "COMPLETE").exists():
            rounds.append(int(m.group(1)))
    return sorted(rounds)


def latest(root: AnyPath | str) -> AnyPath | None:
    """The newest intact round (see ``latest_intact``)."""
    return latest_intact(root)[0]


# ---------------------------------------------------------------------- round records
RECORDS = "records"
"""The journal of round records beside a run's round folders (never pruned: a record is small)."""


def record_path(root: AnyPath | str, rnd: int) -> AnyPath:
    return location(root) / RECORDS / f"round_{rnd:04d}.json"


def write_record(root: AnyPath | str, rnd: int, record: dict[str, Any]) -> None:
    """Round ``rnd``'s record (its report: metrics, each client's, artifacts, failures, the timestamp
    its metrics are logged with) in the journal, fsynced: written before the round is committed, so a
    committed round always has its record (``RoundCheckpoints.seal``)."""
    folder = location(root) / RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    data = dict(record)
    data["artifacts"] = {name: base64.b64encode(v if isinstance(v, bytes) else str(v).encode()).decode()
                         for name, v in record.get("artifacts", {}).items()}
    data["client_metrics"] = {str(cid): m for cid, m in record.get("client_metrics", {}).items()}
    data["failures"] = {str(cid): why for cid, why in record.get("failures", {}).items()}
    data["retried"] = {str(cid): why for cid, why in record.get("retried", {}).items()}
    write_json(record_path(root, rnd), data)


def read_record(root: AnyPath | str, rnd: int) -> dict[str, Any] | None:
    """Round ``rnd``'s record as it was written (artifacts as bytes, clients as ints); None if none."""
    path = record_path(root, rnd)
    if not path.exists():
        return None
    data = read_json(path)
    data["artifacts"] = {name: base64.b64decode(v) for name, v in data.get("artifacts", {}).items()}
    data["client_metrics"] = {int(cid): m for cid, m in data.get("client_metrics", {}).items()}
    data["failures"] = {int(cid): why for cid, why in data.get("failures", {}).items()}
    data["retried"] = {int(cid): why for cid, why in data.get("retried", {}).items()}
    return data


def record_queued(root: AnyPath | str, rnd: int) -> bool:
    """Whether round ``rnd``'s record was handed to the tracking outbox (:func:`mark_queued`)."""
    return (location(root) / RECORDS / f"round_{rnd:04d}.queued").exists()


def mark_queued(root: AnyPath | str, rnd: int) -> None:
    """Round ``rnd``'s record is in the tracking outbox (written only after the outbox has it on disk)."""
    write_json(location(root) / RECORDS / f"round_{rnd:04d}.queued", {"round": rnd})


# ------------------------------------------------------------------- optimiser state


def optimizer_to_tensors(state_dict: dict) -> tuple[Params, dict]:
    """Split a torch optimiser state dict into tensors and JSON."""
    tensors, scalars = {}, {}
    for idx, slots in state_dict["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_from_tensors(tensors: Params, meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta.get("scalars", {}).items()):
        idx, _, name = key.partition(".")
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}
