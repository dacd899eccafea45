"""Fault injection for the recovery tests, set through one environment variable.

``FEDSWEEP_FAULT=point:round:client:marker[;…]`` arms a fault at ``point`` of ``round`` for
``client``; it fires once (the marker file records that it fired). The faults sit at the actors'
call boundaries, never in training code: where the variable is set, ``actors.remote`` makes Ray
actors of :func:`with_faults`' subclasses, which check the points as a call enters and before it
answers, and passes the variable on to them; unset, the plain classes run, untouched.
"""

from __future__ import annotations

import os
import threading
from typing import Any

FAULT_ENV = "FEDSWEEP_FAULT"

SIGNALS = ("poison", "hold_commit")
"""Points that do not end the process but tell the caller to act: ``poison`` (corrupt that client's
update: a diverged client), ``hold_commit`` (the server's writer holds a deferred round's commit until
the round thread asks for it, so that only a later checkpoint or the run's tear-down commits it;
its "client" is 0)."""


def fault_point(point: str, rnd: int, cid: int) -> bool:
    """Fire the fault armed for (point, round, client), if any. Client actor points that end the
    process: train_start, train_end (trained, result not yet returned), evaluate, save; write (a
    deferred save's files are being written and the next round's training has begun). ``raise``
    raises before training (a client's error in a call that trains several). :data:`SIGNALS` return
    True. Returns False when nothing is armed."""
    spec = fault_armed(point, rnd, cid)
    if spec is None:
        return False
    with open(spec, "w") as fh:
        fh.write(f"{point} round {rnd} client {cid}\n")
    if point in SIGNALS:
        return True
    if point == "raise":
        raise RuntimeError(f"injected fault before training client {cid} in round {rnd}")
    os._exit(1)


def fault_armed(point: str, rnd: int, cid: int) -> str | None:
    """The marker file of a fault set for (point, round, client) that has not fired yet, or None."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(";")):
        want, r, c, marker = spec.split(":", 3)
        if want == point and int(r) == rnd and int(c) == cid and not os.path.exists(marker):
            return marker
    return None


def _round_of(directory: str) -> int:
    """The round a checkpoint stage folder is for (``…/round_0003.partial`` -> 3; -1 if none)."""
    name = os.path.basename(os.path.normpath(str(directory))).removesuffix(".partial")
    tail = name.split("_")[-1]
    return int(tail) if tail.isdigit() else -1


def with_faults(cls: type) -> type:
    """``cls`` (a ClientActor) with the armed faults at its call boundaries: ``train_start`` and
    ``raise`` as a client's training begins (alone, or in a lockstep batch); ``poison`` (its trained adapter and upload times 10⁴: a
    diverged client), then ``train_end``, once it has trained and before it answers; ``evaluate``
    as a client's evaluation begins; ``save`` as a checkpoint call begins and, after a deferred one
    has answered, ``write`` (the process dies while its files are written, once the next round's
    training has begun)."""

    class WithFaults(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._trained_since_save = threading.Event()

        def train(self, rnd: int, cid: int, payload):
            fault_point("train_start", rnd, cid)
            fault_point("raise", rnd, cid)
            self._trained_since_save.set()
            return self._trained(rnd, cid, super().train(rnd, cid, payload))

        def train_lockstep(self, rnd: int, work):
            for cid, _ in work:  # a client's raise fails its batch: each of its clients is retried alone
                fault_point("train_start", rnd, cid)
                fault_point("raise", rnd, cid)
            self._trained_since_save.set()
            results = super().train_lockstep(rnd, work)
            return {cid: self._trained(rnd, cid, result) for cid, result in results.items()}

        def _trained(self, rnd: int, cid: int, result):
            if fault_point("poison", rnd, cid):
                self.slots[cid].params = {k: v * 1e4 for k, v in self.slots[cid].params.items()}
                up = result.upload
                up.params = {k: v * 1e4 for k, v in up.params.items()} if up.params else up.params
            fault_point("train_end", rnd, cid)
            return result

        def evaluate(self, rnd: int, cid: int, payload):
            fault_point("evaluate", rnd, cid)
            return super().evaluate(rnd, cid, payload)

        def evaluate_many(self, rnd: int, groups):
            for cids, _ in groups:
                for cid in cids:
                    fault_point("evaluate", rnd, cid)
            return super().evaluate_many(rnd, groups)

        def save(self, directory: str, previous: str | None = None, defer: bool = False) -> dict[str, Any]:
            rnd, first = _round_of(directory), (min(self.slots) if self.slots else -1)
            fault_point("save", rnd, first)
            out = super().save(directory, previous, defer)
            if defer:
                self._trained_since_save.clear()
                if fault_armed("write", rnd, first):
                    with self._deferred_lock:
                        self._deferred[directory].add(self._writer().submit(self._die_while_training, rnd, first))
            return out

        def _die_while_training(self, rnd: int, cid: int) -> dict:
            self._trained_since_save.wait(600)
            fault_point("write", rnd, cid)
            return {}

    WithFaults.__name__ = WithFaults.__qualname__ = cls.__name__
    WithFaults.__module__ = cls.__module__
    return WithFaults


def server_with_faults(cls: type) -> type:
    """``cls`` (the ServerActor) with ``hold_commit``: the writer thread holds a deferred round's commit
    until the round thread asks for it, so that only a later checkpoint or the run's tear-down commits
    it (its "client" is 0)."""

    class WithFaults(cls):
        def _commit_written(self, d, known: dict) -> None:
            if fault_point("hold_commit", d.rnd, 0):
                d.asked.wait(self.timeout)
            super()._commit_written(d, known)

    WithFaults.__name__ = WithFaults.__qualname__ = cls.__name__
    WithFaults.__module__ = cls.__module__
    return WithFaults
