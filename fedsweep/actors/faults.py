"""Fault injection for the recovery tests, set through one environment variable.

``FEDSWEEP_FAULT=point:round:client:marker[;…]`` arms a fault at ``point`` of ``round`` for
``client``; it fires once (the marker file records that it fired). Where the variable is set,
``actors.remote`` gives each actor a :class:`FaultPoints` as its ``faults`` constructor argument;
the actors ask it at their call boundaries only, never in training code (a run has none: the
argument is None).

Client actor points that end the process: ``train_start`` (a client's training begins, alone or in
a group), ``train_end`` (trained, result not yet returned), ``evaluate``, ``save`` (a checkpoint call
begins; its "client" is the actor's first), ``write`` (a deferred save's files are being written and
the next round's training has begun). ``raise`` raises before training (a client's error in a call
that trains several). The server actor's point: ``server`` (its round's clients have trained, nothing
aggregated yet; "client" 0). :data:`SIGNALS` do not end the process but tell the caller to act.
"""

from __future__ import annotations

import os

FAULT_ENV = "FEDSWEEP_FAULT"

SIGNALS = ("poison", "hold_commit")
"""``poison`` (the actor corrupts that client's update: a diverged client), ``hold_commit`` (the
server's writer holds a deferred round's commit until the round thread asks for it, so that only a
later checkpoint or the run's tear-down commits it; its "client" is 0)."""


class FaultPoints:
    """The faults armed by ``spec`` (the variable's value)."""

    def __init__(self, spec: str):
        self.spec = spec

    @classmethod
    def from_env(cls) -> "FaultPoints | None":
        spec = os.environ.get(FAULT_ENV, "")
        return cls(spec) if spec else None

    def armed(self, point: str, rnd: int, cid: int) -> str | None:
        """The marker file of a fault set for (point, round, client) that has not fired yet, or None."""
        for item in filter(None, self.spec.split(";")):
            want, r, c, marker = item.split(":", 3)
            if want == point and int(r) == rnd and int(c) == cid and not os.path.exists(marker):
                return marker
        return None

    def at(self, point: str, rnd: int, cid: int) -> bool:
        """Fire the fault armed for (point, round, client), if any: :data:`SIGNALS` return True,
        ``raise`` raises, the others end the process. False when nothing is armed."""
        marker = self.armed(point, rnd, cid)
        if marker is None:
            return False
        with open(marker, "w") as fh:
            fh.write(f"{point} round {rnd} client {cid}\n")
        if point in SIGNALS:
            return True
        if point == "raise":
            raise RuntimeError(f"injected fault before training client {cid} in round {rnd}")
        os._exit(1)

    # --------------------------------------------------------- checkpoint points
    def before_train(self, rnd: int, cids: list[int]) -> None:
        """The ``train_start`` and ``raise`` points of each client of a training group."""
        for cid in cids:  # a client's raise fails its group: each of its clients is retried alone
            self.at("train_start", rnd, cid)
            self.at("raise", rnd, cid)

    def after_train(self, rnd: int, results: dict, slots: dict) -> None:
        """The ``poison`` point (a diverged client: its adapter and upload ×10⁴), then ``train_end``."""
        for cid in results:
            if self.at("poison", rnd, cid):
                slot, up = slots[cid], results[cid].upload
                slot.params = {k: v * 1e4 for k, v in slot.params.items()}
                up.params = {k: v * 1e4 for k, v in up.params.items()} if up.params else up.params
            self.at("train_end", rnd, cid)

    def before_save(self, directory: str, slots: dict) -> None:
        self.at("save", round_of(directory), min(slots) if slots else -1)

    def after_deferred_save(self, actor, directory: str, pending) -> None:
        """Arm ``write``: the actor's writer dies while the deferred save's files are written, once the
        next round's training has begun."""
        rnd, first = round_of(directory), (min(actor.slots) if actor.slots else -1)
        actor.trained_since_save.clear()
        if self.armed("write", rnd, first):
            def die_while_training() -> dict:
                actor.trained_since_save.wait(600)
                self.at("write", rnd, first)
                return {}

            actor.saves.write_beside(pending, die_while_training)

    def hold_commit(self, d, timeout: float) -> None:
        """The server's writer thread holds deferred round ``d``'s commit until the round thread asks."""
        if self.at("hold_commit", d.rnd, 0):
            d.asked.wait(timeout)


def round_of(directory: str) -> int:
    """The round a checkpoint stage folder is for (``…/round_0003.partial`` -> 3; -1 if none)."""
    name = os.path.basename(os.path.normpath(str(directory))).removesuffix(".partial")
    tail = name.split("_")[-1]
    return int(tail) if tail.isdigit() else -1
