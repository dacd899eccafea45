"""Tracking that survives its server: every write to MLflow goes through an outbox on disk.

A write (a batch of metrics, params and tags; an artifact; a run's status) is one JSON file in the
outbox folder, fsynced and renamed into place before :meth:`Outbox.put` returns, so the caller never
waits on the tracking server. A sender thread delivers the files in order and removes each once
MLflow took it. While the server does not answer, the files wait (the console says so once, with
how many wait, and again when it answers); each retry waits longer, up to
:data:`MAX_BACKOFF_S`. A run that ends while the server is away waits for it up to
``tracking.wait_s`` (:meth:`Outbox.drain`); what is still there after that, or after the process was
killed, is sent by the next run that resumes from the folder or by ``fedsweep runs --sync``
(:func:`sync`).

Every metric carries the timestamp it was first given (a round's record fixes it), so sending a
write twice logs nothing twice: MLflow's stores drop a metric whose key, value, step and
timestamp are all already there; params, tags, artifacts and a status are the same write again.

A write MLflow refuses as malformed (a bad value, a run deleted meanwhile) is set aside as
``NNNNNNNN.refused.json`` beside the others with the reason, so that one bad record does not hold
back the rest.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

MAX_BACKOFF_S = 30.0
"""The longest wait between two tries while the tracking server does not answer."""
OUTBOX = "tracking-outbox"
"""The outbox's folder name inside a run's (or a study's) folder."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def unreachable(exc: BaseException) -> bool:
    """Whether a failed write means the server did not answer (try again later), not that it refused
    the write (MLflow's own errors with a client-side error code: set aside)."""
    code = getattr(exc, "error_code", None)
    if code and code not in ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"):
        text = str(exc)
        return "API request to" in text or "Max retries" in text or "Connection" in text
    return True


class Outbox:
    """The tracking writes of one run (or study) to the MLflow server at ``uri``, kept in ``folder``
    until delivered. ``say(line)``: where to announce that the server went away or came back."""

    def __init__(self, uri: str, folder: Path, say: Callable[[str], None] | None = None, start: bool = True,
                 client=None):
        self.uri, self.folder, self.say = uri, Path(folder), say or (lambda line: None)
        self._client = client  # (an MlflowClient of ``uri`` is made by the sender where none is given)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "uri").write_text(uri)
        self._lock = threading.Condition()
        self._seq = max([int(p.name.split(".")[0]) for p in self._pending()] + [0])
        self._stop = False
        self.away_since: float | None = None
        self.sent = 0
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, name="fedsweep-tracking-outbox", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ writes
    def put(self, op: dict[str, Any]) -> None:
        """Keep one write on disk (it survives this process) and wake the sender."""
        with self._lock:
            self._seq += 1
            _write_atomic(self.folder / f"{self._seq:08d}.json", json.dumps(op).encode())
            self._lock.notify_all()

    def batch(self, run_id: str, metrics: list[tuple[str, float, int, int]] = (), params: dict[str, str] | None = None,
              tags: dict[str, str] | None = None) -> None:
        """Metrics ``(key, value, timestamp_ms, step)``, params and tags of ``run_id``, as one write."""
        self.put({"op": "batch", "run": run_id, "metrics": [list(m) for m in metrics],
                  "params": sorted((params or {}).items()), "tags": sorted((tags or {}).items())})

    def artifact(self, run_id: str, path: str, data: bytes) -> None:
        self.put({"op": "artifact", "run": run_id, "path": path, "data": base64.b64encode(data).decode()})

    def status(self, run_id: str, status: str) -> None:
        self.put({"op": "status", "run": run_id, "status": status})

    # ------------------------------------------------------------------ delivery
    def _pending(self) -> list[Path]:
        return sorted(p for p in self.folder.glob("*.json") if p.name.split(".")[0].isdigit()
                      and not p.name.endswith(".refused.json"))

    def waiting(self) -> int:
        """Writes not delivered yet."""
        return len(self._pending())

    def _run(self) -> None:
        from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

        client = self._client or MlflowClient(tracking_uri=self.uri)
        backoff = 1.0
        while True:
            with self._lock:
                while not self._stop and not self._pending():
                    self._lock.wait(1.0)
                if self._stop and not self._pending():
                    return
            try:
                delivered = self.deliver_one(client)
            except Exception as exc:  # noqa: BLE001  (the sender must outlive anything: the writes stay)
                self.say(f"tracking outbox: {type(exc).__name__}: {exc}")
                delivered = False
            if not delivered:
                with self._lock:
                    self._lock.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            else:
                backoff = 1.0

    def deliver_one(self, client) -> bool:
        """Send the oldest waiting write; False where the server did not answer (it stays)."""
        pending = self._pending()
        if not pending:
            return True
        path = pending[0]
        op = json.loads(path.read_text())
        try:
            send(client, op)
        except Exception as exc:  # noqa: BLE001  (the server's errors and the network's alike)
            if unreachable(exc):
                if self.away_since is None:
                    self.away_since = time.monotonic()
                    self.say(f"tracking server {self.uri} does not answer: {self.waiting()} record(s) wait in "
                             f"{self.folder} and are sent when it is back (training goes on)")
                return False
            refused = path.with_name(path.name.replace(".json", ".refused.json"))
            refused.write_text(json.dumps({"op": op, "reason": str(exc).splitlines()[0][:500]}))
            path.unlink()
            self.say(f"tracking server refused a record (kept in {refused}): {str(exc).splitlines()[0][:200]}")
            return True
        path.unlink()
        self.sent += 1
        if self.away_since is not None:
            self.say(f"tracking server {self.uri} answers again after {time.monotonic() - self.away_since:.0f} s: "
                     f"sending the {self.waiting() + 1} record(s) that waited")
            self.away_since = None
        return True

    def drain(self, wait_s: float, every_s: float = 30.0) -> int:
        """Wait until every write is delivered, at most ``wait_s`` seconds (saying every ``every_s``
        seconds how many wait); the number still waiting."""
        deadline = time.monotonic() + wait_s
        last = time.monotonic()
        while self.waiting() and time.monotonic() < deadline:
            time.sleep(0.2)
            if self.away_since is not None and time.monotonic() - last > every_s:
                last = time.monotonic()
                self.say(f"waiting for the tracking server {self.uri}: {self.waiting()} record(s) wait "
                         f"({deadline - time.monotonic():.0f} s more; Ctrl-C leaves them for fedsweep runs --sync)")
        return self.waiting()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)


def send(client, op: dict[str, Any]) -> None:
    """One write of an outbox to MLflow."""
    import tempfile

    from fedsweep.orchestrator.tracking.mlflow_api import Metric, Param, RunStatus, RunTag

    run = op["run"]
    if op["op"] == "batch":
        client.log_batch(run, metrics=[Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in op["metrics"]],
                         params=[Param(k, v) for k, v in op["params"]], tags=[RunTag(k, v) for k, v in op["tags"]])
    elif op["op"] == "artifact":
        path = Path(op["path"])
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / path.name
            local.write_bytes(base64.b64decode(op["data"]))
            parent = str(path.parent)
            client.log_artifact(run, str(local), None if parent == "." else parent)
    elif op["op"] == "status":
        client.set_terminated(run, status=RunStatus.to_string(RunStatus.from_string(op["status"])))
    else:
        raise ValueError(f"unknown tracking write {op['op']!r}")


def outboxes(root: Path) -> list[Path]:
    """Every outbox folder below ``root`` with writes waiting."""
    return sorted(p for p in Path(root).rglob(OUTBOX) if p.is_dir() and any(
        q.name.split(".")[0].isdigit() and not q.name.endswith(".refused.json") for q in p.glob("*.json")))


def sync(root: Path, say: Callable[[str], None], wait_s: float = 60.0) -> tuple[int, int]:
    """Deliver the writes waiting in every outbox below ``root`` (``fedsweep runs --sync``); (delivered,
    still waiting)."""
    delivered = left = 0
    for folder in outboxes(root):
        uri = (folder / "uri").read_text().strip()
        box = Outbox(uri, folder, say)
        before = box.waiting()
        left_here = box.drain(wait_s)
        box.close()
        delivered += before - left_here
        left += left_here
        say(f"{folder}: {before - left_here} of {before} record(s) sent to {uri}")
    return delivered, left
