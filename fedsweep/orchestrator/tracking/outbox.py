"""Tracking that survives its server: every write to MLflow goes through an outbox on disk.

A write (the run's opening, a batch of metrics, params and tags; an artifact; a run's status) is one
JSON file in the outbox folder, written whole (``storage.write_atomic``: temp, fsync, rename, folder
fsynced; the user's alone) before :meth:`Outbox.put` returns, so the caller never waits on the
tracking server. A sender thread delivers the files in order and removes each once MLflow took it.
While the server does not answer, the files wait (the console says so once, with how many wait,
and again when it answers); each retry waits longer, up to :data:`MAX_BACKOFF_S`. A run that ends
while the server is away waits for it up to ``tracking.wait_s`` (:meth:`Outbox.drain`); what is
still there after that, or after the process was killed, is sent by the next run that resumes from
the folder, by a study's driver (its trials' outboxes) or by ``fedsweep runs --sync`` (:func:`sync`).

The server need not answer for a run to start: the run's *opening* (its experiment, name, tags,
parent; the run its folder's tag names where a resumed run lost its id) is the outbox's first write,
and every write after it names the run as :data:`PENDING_RUN` until the opening is delivered and the
run's id is known (kept in the folder's ``run_id``; ``on_open(run_id)`` tells the run).

Every metric carries the timestamp it was first given (a round's record fixes it), so sending a
write twice logs nothing twice: MLflow's stores drop a metric whose key, value, step and
timestamp are all already there; params, tags, artifacts and a status are the same write again.

A write MLflow refuses as malformed (a bad value, a run deleted meanwhile) is set aside as
``NNNNNNNN.refused.json`` beside the others with the reason, and a file that cannot be read as
``NNNNNNNN.unreadable``, so that one bad record does not hold back the rest. A live outbox holds the
folder's ``lock`` (``flock``): ``runs --sync`` and a study's driver deliver only outboxes nobody
holds. The folder keeps the store's URI without credentials (``uri``); a sync to another store is
refused.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fedsweep.storage import named_below, private_dir, without_userinfo, write_atomic

MAX_BACKOFF_S = 30.0
"""The longest wait between two tries while the tracking server does not answer."""
OUTBOX = "tracking-outbox"
"""The outbox's folder name inside a run's (or a study's) folder."""
PENDING_RUN = "@run"
"""How a write names its run before the run's opening is delivered (the id is not known yet)."""


def unreachable(exc: BaseException) -> bool:
    """Whether a failed write means the server did not answer (try again later), not that it refused
    the write (MLflow's own errors with a client-side error code: set aside)."""
    code = getattr(exc, "error_code", None)
    if code and code not in ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"):
        text = str(exc)
        return "API request to" in text or "Max retries" in text or "Connection" in text
    return True


def _numbered(path: Path) -> bool:
    return path.name.split(".")[0].isdigit()


class OutboxBusy(RuntimeError):
    """Another live process holds the outbox (its run still runs)."""


class Outbox:
    """The tracking writes of one run (or study) to the MLflow server at ``uri``, kept in ``folder``
    until delivered. ``say(line)``: where to announce that the server went away or came back;
    ``on_open(run_id)``: called (in the sender's thread) once the run's opening is delivered.
    ``hold``: take the folder's lock (:class:`OutboxBusy` where a live process has it)."""

    def __init__(self, uri: str, folder: Path, say: Callable[[str], None] | None = None, start: bool = True,
                 client=None, on_open: Callable[[str], None] | None = None, hold: bool = True):
        self.uri, self.folder = uri, Path(folder)
        self._say = say or (lambda line: None)
        self.shown = without_userinfo(uri)
        self.on_open = on_open
        self._client = client  # (an MlflowClient of ``uri`` is made by the sender where none is given)
        private_dir(self.folder)
        self._lock_fd = None
        if hold:
            self._lock_fd = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._lock_fd)
                self._lock_fd = None
                raise OutboxBusy(f"{self.folder} is in use by a live run") from None
        kept = self.folder / "uri"
        if not kept.exists():
            write_atomic(kept, self.shown.encode())
        self.run_id = self._kept_run_id()
        self._lock = threading.Condition()
        self._seq = max([int(p.name.split(".")[0]) for p in self.folder.iterdir() if _numbered(p)] + [0])
        self._stop = False
        self.away_since: float | None = None
        self.sent = self.refused = 0
        self._thread = None
        if start:
            self.start()

    def say(self, line: str) -> None:
        self._say(without_userinfo(line))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fedsweep-tracking-outbox", daemon=True)
            self._thread.start()

    def _kept_run_id(self) -> str | None:
        try:
            return (self.folder / "run_id").read_text().strip() or None
        except OSError:
            return None

    def store(self) -> str:
        """The store this outbox delivers to, as kept (without credentials)."""
        return (self.folder / "uri").read_text().strip()

    # ------------------------------------------------------------------ writes
    def put(self, op: dict[str, Any]) -> None:
        """Keep one write on disk (it survives this process) and wake the sender."""
        with self._lock:
            self._seq += 1
            write_atomic(self.folder / f"{self._seq:08d}.json", json.dumps(op).encode())
            self._lock.notify_all()

    def run_ref(self) -> str:
        """How a write made now names its run: its id, or :data:`PENDING_RUN` while the opening waits."""
        return self.run_id or PENDING_RUN

    def open(self, experiment: str, run_name: str | None, tags: dict[str, str], parent_run_id: str | None,
             find_folder: str | None, view: dict[str, Any] | None, artifact_root: str | None) -> None:
        """The run's opening, as the outbox's next write (none where one already waits: a resumed run's
        first driver queued it and died)."""
        if any(op.get("op") == "open" for op in self._read_pending()):
            return
        self.put({"op": "open", "experiment": experiment, "run_name": run_name, "tags": tags,
                  "parent": parent_run_id, "find_folder": find_folder, "view": view, "artifact_root": artifact_root})

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
        return sorted(p for p in self.folder.glob("*.json") if _numbered(p) and not p.name.endswith(".refused.json"))

    def _read_pending(self) -> list[dict[str, Any]]:
        out = []
        for path in self._pending():
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return out

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
                if self._stop:  # (closed: what waits stays on disk for whoever holds the folder next)
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
        try:
            op = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            aside = path.with_name(path.name.replace(".json", ".unreadable"))
            os.replace(path, aside)
            self.say(f"tracking outbox: {path.name} cannot be read ({type(exc).__name__}): set aside as {aside}")
            return True
        try:
            opened = self._send(client, op)
        except Exception as exc:  # noqa: BLE001  (the server's errors and the network's alike)
            if unreachable(exc):
                if self.away_since is None:
                    self.away_since = time.monotonic()
                    self.say(f"tracking server {self.shown} does not answer: {self.waiting()} record(s) wait in "
                             f"{self.folder} and are sent when it is back (training goes on)")
                return False
            refused = path.with_name(path.name.replace(".json", ".refused.json"))
            write_atomic(refused, json.dumps({"op": op, "reason": str(exc).splitlines()[0][:500]}).encode())
            path.unlink()
            self.refused += 1
            self.say(f"tracking server refused a record (kept in {refused}): {str(exc).splitlines()[0][:200]}")
            return True
        path.unlink()
        self.sent += 1
        if opened and self.on_open is not None:
            self.on_open(opened)
        if self.away_since is not None:
            self.say(f"tracking server {self.shown} answers again after {time.monotonic() - self.away_since:.0f} s: "
                     f"sending the {self.waiting() + 1} record(s) that waited")
            self.away_since = None
        return True

    def _send(self, client, op: dict[str, Any]) -> str | None:
        """One write; the run's id where the write was its opening."""
        if op.get("op") == "open":
            self.run_id = open_run(client, op)
            write_atomic(self.folder / "run_id", self.run_id.encode())
            return self.run_id
        if op.get("run") == PENDING_RUN:
            if not self.run_id:
                raise ValueError("a write names the pending run but the outbox has no opening")
            op = {**op, "run": self.run_id}
        send(client, op)
        return None

    def drain(self, wait_s: float, every_s: float = 30.0, leave_when_away: bool = False) -> int:
        """Wait until every write is delivered, at most ``wait_s`` seconds (saying every ``every_s``
        seconds how many wait; ``leave_when_away``: not at all while the server does not answer, as a
        study's trial does: its driver sends them); the number still waiting."""
        deadline = time.monotonic() + wait_s
        last = time.monotonic()
        while self.waiting() and time.monotonic() < deadline:
            if leave_when_away and self.away_since is not None:
                break
            time.sleep(0.2)
            if self.away_since is not None and time.monotonic() - last > every_s:
                last = time.monotonic()
                self.say(f"waiting for the tracking server {self.shown}: {self.waiting()} record(s) wait "
                         f"({deadline - time.monotonic():.0f} s more; Ctrl-C leaves them for fedsweep runs --sync)")
        return self.waiting()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (the flock goes with it)
            self._lock_fd = None


def open_run(client, op: dict[str, Any]) -> str:
    """An opening delivered: the experiment made (or marked as training), the run the folder's tag names
    continued where there is one, else a new run; fedsweep's saved view where asked. The run's id."""
    from fedsweep.orchestrator.tracking.ui import KIND_TAG, KIND_TRAINING, VIEW_KEY, VIEW_TAG_PREFIX, mark_training, save_view

    name = op["experiment"]
    exp = client.get_experiment_by_name(name)
    if exp is None:
        root = op.get("artifact_root")
        exp_id = client.create_experiment(name, artifact_location=f"{root}/{name}" if root else None,
                                          tags={KIND_TAG: KIND_TRAINING})
        exp = client.get_experiment(exp_id)
    else:
        mark_training(client, exp)
    run_id = run_of_folder(client, exp.experiment_id, op["find_folder"]) if op.get("find_folder") else None
    if run_id:
        client.update_run(run_id, status="RUNNING")
    else:
        tags = dict(op.get("tags") or {})
        if op.get("parent"):
            tags["mlflow.parentRunId"] = op["parent"]
        run_id = client.create_run(exp.experiment_id, run_name=op.get("run_name"), tags=tags).info.run_id
    view = op.get("view")
    if view is not None and (view.get("replace") or VIEW_TAG_PREFIX + VIEW_KEY not in exp.tags):
        save_view(client, exp.experiment_id, view["metric"], view["mode"], view["charts"])
    return run_id


def run_of_folder(client, experiment_id: str, run_dir: str) -> str | None:
    """The newest run of ``experiment_id`` tagged with the run folder ``run_dir`` (:data:`RUN_DIR_TAG`), or None."""
    if '"' not in run_dir:  # (MLflow's filter quotes a value in double quotes; a folder with one is searched by hand)
        found = client.search_runs([experiment_id], filter_string=f'tags."{RUN_DIR_TAG}" = "{run_dir}"',
                                   order_by=["attributes.start_time DESC"], max_results=1)
    else:
        found = [r for r in client.search_runs([experiment_id], order_by=["attributes.start_time DESC"])
                 if r.data.tags.get(RUN_DIR_TAG) == run_dir][:1]
    return found[0].info.run_id if found else None


RUN_DIR_TAG = "fedsweep.run_dir"
"""The tag that names a run's folder: how a run is found again where its id was never kept."""


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
    elif op["op"] == "running":  # a resumed run's status again
        client.update_run(run, status="RUNNING")
    elif op["op"] == "status":
        client.set_terminated(run, status=RunStatus.to_string(RunStatus.from_string(op["status"])))
    else:
        raise ValueError(f"unknown tracking write {op['op']!r}")


def outboxes(root: Path) -> list[Path]:
    """Every outbox folder below ``root`` with writes waiting (read while the trials there run)."""
    return [p for p in named_below(Path(root), OUTBOX) if p.is_dir() and any(
        _numbered(q) and not q.name.endswith(".refused.json") for q in p.glob("*.json"))]


def sync(root: Path, say: Callable[[str], None], wait_s: float = 60.0, uri: str | None = None) -> dict[str, int]:
    """Deliver the writes waiting in every outbox below ``root`` that no live run holds (``fedsweep runs
    --sync``, a study's driver for its trials). ``uri``: the store to deliver to, with its credentials
    where the outbox keeps none; an outbox kept for another store is refused, both named. Counts:
    ``sent``, ``refused`` (set aside by the server), ``waiting`` (the server did not answer), ``busy``
    (outboxes of live runs) and ``other_store``."""
    out = {"sent": 0, "refused": 0, "waiting": 0, "busy": 0, "other_store": 0}
    for folder in outboxes(root):
        kept = (folder / "uri").read_text().strip() if (folder / "uri").exists() else None
        if uri is not None and kept is not None and without_userinfo(uri) != kept:
            say(f"{folder}: its records are for {kept}, not {without_userinfo(uri)}: not sent (sync with --uri {kept})")
            out["other_store"] += 1
            continue
        try:
            box = Outbox(uri or kept, folder, say, start=False)
        except OutboxBusy:
            say(f"{folder}: in use by a live run (it sends its own records)")
            out["busy"] += 1
            continue
        before = box.waiting()
        box.start()
        left_here = box.drain(wait_s)
        box.close()
        out["sent"] += box.sent
        out["refused"] += box.refused
        out["waiting"] += left_here
        say(f"{folder}: {box.sent} of {before} record(s) sent to {box.shown}"
            + (f", {box.refused} refused (kept as .refused.json)" if box.refused else ""))
    return out
