"""Fault injection for the recovery tests, set through one environment variable.

``FEDSWEEP_FAULT=point:round:client:marker[;…]`` arms a fault at ``point`` of ``round`` for
``client``; it fires once (the marker file records that it fired). The runner passes the variable
to the client actors and the server (``actors.remote``); unset, every check is one lookup.
"""

from __future__ import annotations

import os

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
