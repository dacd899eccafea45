"""A study driver's courier: the tracking records its ended trials left in their outboxes, delivered.

A trial never holds its placement group waiting for the tracking server (``Tracker.finish`` with
``leave_when_away``): what its outbox still holds when it ends waits on disk beside its run folder.
The study's driver runs a :class:`Courier` over the study's folder: every few seconds it takes each
outbox no live trial holds (``outbox.OutboxBusy``), sends what it can, and tells ``on_count`` how many
records wait in all (the study's progress line says so while the server is away). At the study's end
:meth:`Courier.finish` waits for the rest, up to the study's wait.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from fedsweep.orchestrator.tracking.outbox import Outbox, OutboxBusy, outboxes, unreachable


class Courier:
    """Delivers the outboxes below ``root`` (a study's trials) to ``uri`` in a thread of its own."""

    def __init__(self, root: Path, uri: str, on_count: Callable[[int, bool], None] | None = None,
                 say: Callable[[str], None] | None = None, every_s: float = 5.0, client=None):
        self.root, self.uri, self.every_s = Path(root), uri, every_s
        self.on_count = on_count or (lambda waiting, away: None)
        self.say = say or (lambda line: None)
        self._client = client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.away = False
        self.sent = 0

    def start(self) -> "Courier":
        self._thread = threading.Thread(target=self._loop, name="fedsweep-tracking-courier", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.deliver()
            except Exception as exc:  # noqa: BLE001  (the courier outlives anything: the records stay on disk)
                self.say(f"tracking courier: {type(exc).__name__}: {exc}")

    def client(self):
        if self._client is None:
            from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def deliver(self) -> int:
        """One pass: every outbox nobody holds, sent until it is empty or the server stops answering;
        the number of records that wait below ``root`` afterwards (held ones included)."""
        waiting, away = 0, False
        for folder in outboxes(self.root):
            try:
                box = Outbox(self.uri, folder, self.say, start=False)
            except OutboxBusy:
                waiting += sum(1 for p in folder.glob("*.json") if p.name.split(".")[0].isdigit()
                               and not p.name.endswith(".refused.json"))
                continue
            try:
                while not away and box.waiting():
                    try:
                        if not box.deliver_one(self.client()):
                            away = True
                    except Exception as exc:  # noqa: BLE001
                        if not unreachable(exc):
                            raise
                        away = True
                self.sent += box.sent
                waiting += box.waiting()
            finally:
                box.close()
        if away != self.away:
            self.say("tracking server " + ("does not answer: the trials' records wait on disk" if away
                                           else "answers again: sending the trials' records"))
        self.away = away
        self.on_count(waiting, away)
        return waiting

    def finish(self, wait_s: float) -> int:
        """Stop the thread; then deliver until nothing waits or ``wait_s`` passed. The number still waiting."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        deadline = time.monotonic() + wait_s
        left = self.deliver()
        while left and time.monotonic() < deadline:
            time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
            left = self.deliver()
        return left
