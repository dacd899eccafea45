"""What a round is doing, for the driver's progress line (``ServerActor.progress``)."""

from __future__ import annotations

import threading
from typing import Any


class Progress:
    """The round, its phase, clients done of total, the last training loss (read while a round runs: a lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {"round": 0, "phase": "idle", "done": 0, "total": 0, "loss": None}

    def set(self, **kw) -> None:
        with self._lock:
            self._state.update(kw)

    def add_done(self, n: int) -> None:
        with self._lock:
            self._state["done"] += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._state)
