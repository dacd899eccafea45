"""A client actor's checkpoints: its clients' state saved now or deferred, and waited for.

A deferred save answers at once: the clients' state is copied out and written on this actor's
writer threads while the next round trains (``checkpoint.overlap``); whatever changes a client waits
for the copies first (:meth:`ClientSaves.wait_copied`), a save never overtakes an earlier one, and
the server collects the written files' digests later (:meth:`ClientSaves.saved`).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fedsweep.actors.client_state import SAVE_THREADS, ClientSlot, DeferredSave, save_slots, stage_slots


class ClientSaves:
    """The saves of one actor's clients (``slots``), by round folder until collected."""

    def __init__(self, slots: dict[int, ClientSlot]) -> None:
        self.slots = slots
        self._deferred: dict[str, DeferredSave] = {}
        self._lock = threading.Lock()
        self._write_pool: ThreadPoolExecutor | None = None

    def save(self, directory: str, previous: str | None, defer: bool, token: str) -> tuple[dict[str, Any], Any]:
        """Every client's state into ``directory`` (``client_state.save_slots``), or staged to be written
        (``defer``); (the answer, the deferred save or None)."""
        self.wait_deferred()  # a save never overtakes an earlier one
        if not defer:
            return {**save_slots(self.slots, directory, previous), "token": token}, None
        pending = stage_slots(self.slots, directory, previous, self._writer())
        with self._lock:
            self._deferred[directory] = pending
        return {**pending.staged(), "deferred": True, "token": token}, pending

    def saved(self, directory: str) -> dict[str, Any]:
        """The digests of the deferred save into ``directory`` once written; LookupError if there is none."""
        with self._lock:
            pending = self._deferred.get(directory)
        if pending is None:
            raise LookupError(f"no deferred checkpoint of {directory} in this actor's incarnation")
        out = pending.result()
        with self._lock:
            self._deferred.pop(directory, None)
        return out

    def wait_copied(self) -> None:
        """Before a slot changes: every deferred save has copied its state out."""
        self.wait_deferred(written=False)

    def wait_deferred(self, written: bool = True) -> None:
        """Every deferred save's files on disk (``written``), or its state copied out."""
        with self._lock:
            pending = list(self._deferred.values())
        for p in pending:
            if written:
                p.result()
            else:
                p.copied()

    def forget(self) -> None:
        """Every deferred save written, then forgotten (a new server collects none of them)."""
        self.wait_deferred(written=True)
        with self._lock:
            self._deferred.clear()

    def write_beside(self, pending, job) -> None:
        """Run ``job`` on the writer threads as a part of the deferred save ``pending`` (it counts as
        written once ``job`` is done too): the seam a probe's ``after_deferred_save`` takes."""
        pending.add(self._writer().submit(job))

    def _writer(self) -> ThreadPoolExecutor:
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(SAVE_THREADS, thread_name_prefix="checkpoint")
        return self._write_pool
