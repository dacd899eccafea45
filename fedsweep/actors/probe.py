"""Probes: where the recovery tests inject their faults, and nothing anywhere else.

The client fleet (``actors.fleet``), the client actors and their collaborators are handed a
:class:`Probe` and call it at their call boundaries, whatever the run: the default, :data:`NO_PROBE`,
does nothing. Where ``FEDSWEEP_FAULT=point:round:client:marker[;…]`` is set, ``actors.remote`` hands
them a :class:`FaultProbe` instead, which fires each armed fault once (its marker file records that
it fired; a restarted life reads the markers and does not fire it again).

Client actor points that end the process: ``train_start`` (a client's training begins, alone or in a
group), ``train_end`` (trained, result not yet returned), ``evaluate``, ``save`` (a checkpoint call
begins; its "client" is the actor's first), ``write`` (a deferred save's files are being written and
the next round's training has begun). ``raise`` raises before training (a client's error in a call
that trains several). The fleet's point: ``server`` (the round's clients have trained, nothing
aggregated yet: the server's process dies; "client" 0). Two points do not end the process:
``poison`` (the actor multiplies that client's adapter and upload by 10⁴: a diverged client) and
``hold_commit`` (a deferred round's commit is held until the round thread asks for it, so that only
a later checkpoint or the run's tear-down commits it; "client" 0).

A probe is given what it acts on as arguments (the results and slots it poisons, the deferred
save's ``beside`` hook); it reaches into no object's attributes.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

PROBE_ENV = "FEDSWEEP_FAULT"
"""The environment variable that arms a :class:`FaultProbe`."""


class Probe:
    """The probe points, each a no-op: a run's probe (:data:`NO_PROBE`)."""

    spec = ""

    def before_train(self, rnd: int, cids: list[int]) -> None:
        """A training group of ``cids`` is about to train (after its state is copied out of any save)."""

    def after_train(self, rnd: int, results: dict, slots: dict) -> None:
        """The group trained: its ``results`` (by client) and the actor's ``slots``, before they leave."""

    def before_evaluate(self, rnd: int, cids: list[int]) -> None:
        """An evaluation call for ``cids`` begins."""

    def before_save(self, rnd: int, first: int) -> None:
        """A checkpoint call of round ``rnd`` begins on the actor whose first client is ``first``."""

    def after_deferred_save(self, rnd: int, first: int, beside: Callable[[Callable[[], Any]], None]) -> None:
        """A deferred save was staged; ``beside(job)`` runs ``job`` on its writer threads as a part of it."""

    def round_trained(self, rnd: int) -> None:
        """The fleet: round ``rnd``'s clients have trained, nothing is aggregated yet."""

    def before_commit(self, rnd: int, asked: threading.Event, timeout: float) -> None:
        """The checkpoints' writer thread is about to commit deferred round ``rnd``; ``asked`` is set once
        the round thread waits for that commit."""

    def environment(self) -> dict[str, str]:
        """What an actor's process needs in its environment to get this probe again (a restarted life)."""
        return {}


NO_PROBE = Probe()


class FaultProbe(Probe):
    """The faults armed by ``spec`` (the variable's value)."""

    def __init__(self, spec: str):
        self.spec = spec
        self.trained = threading.Event()  # set by each training group (``write`` waits for it)

    def __getstate__(self) -> dict:  # (an actor's constructor argument: its own event in its process)
        return {"spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec"])

    def environment(self) -> dict[str, str]:
        return {PROBE_ENV: self.spec}

    def armed(self, point: str, rnd: int, cid: int) -> str | None:
        """The marker file of a fault set for (point, round, client) that has not fired yet, or None."""
        for item in filter(None, self.spec.split(";")):
            want, r, c, marker = item.split(":", 3)
            if want == point and int(r) == rnd and int(c) == cid and not os.path.exists(marker):
                return marker
        return None

    def at(self, point: str, rnd: int, cid: int) -> bool:
        """Fire the fault armed for (point, round, client), if any: ``poison`` and ``hold_commit`` return
        True, ``raise`` raises, the others end the process. False when nothing is armed."""
        marker = self.armed(point, rnd, cid)
        if marker is None:
            return False
        with open(marker, "w") as fh:
            fh.write(f"{point} round {rnd} client {cid}\n")
        if point in ("poison", "hold_commit"):
            return True
        if point == "raise":
            raise RuntimeError(f"injected fault before training client {cid} in round {rnd}")
        os._exit(1)

    def before_train(self, rnd: int, cids: list[int]) -> None:
        for cid in cids:  # a client's raise fails its group: each of its clients is retried alone
            self.at("train_start", rnd, cid)
            self.at("raise", rnd, cid)
        self.trained.set()

    def after_train(self, rnd: int, results: dict, slots: dict) -> None:
        for cid in results:
            if self.at("poison", rnd, cid):
                slot, up = slots[cid], results[cid].upload
                slot.params = {k: v * 1e4 for k, v in slot.params.items()}
                up.params = {k: v * 1e4 for k, v in up.params.items()} if up.params else up.params
            self.at("train_end", rnd, cid)

    def before_evaluate(self, rnd: int, cids: list[int]) -> None:
        for cid in cids:
            self.at("evaluate", rnd, cid)

    def before_save(self, rnd: int, first: int) -> None:
        self.at("save", rnd, first)

    def after_deferred_save(self, rnd: int, first: int, beside: Callable[[Callable[[], Any]], None]) -> None:
        """Arm ``write``: the writer dies while the deferred save's files are written, once the next
        round's training has begun."""
        self.trained.clear()
        if self.armed("write", rnd, first):
            def die_while_training() -> dict:
                self.trained.wait(600)
                self.at("write", rnd, first)
                return {}

            beside(die_while_training)

    def round_trained(self, rnd: int) -> None:
        self.at("server", rnd, 0)

    def before_commit(self, rnd: int, asked: threading.Event, timeout: float) -> None:
        if self.at("hold_commit", rnd, 0):
            asked.wait(timeout)


def probe_from_env() -> Probe:
    """A :class:`FaultProbe` where ``FEDSWEEP_FAULT`` is set, else :data:`NO_PROBE`."""
    spec = os.environ.get(PROBE_ENV, "")
    return FaultProbe(spec) if spec else NO_PROBE


def round_of(directory: str) -> int:
    """The round a checkpoint stage folder is for (``…/round_0003.partial`` -> 3; -1 if none)."""
    name = os.path.basename(os.path.normpath(str(directory))).removesuffix(".partial")
    tail = name.split("_")[-1]
    return int(tail) if tail.isdigit() else -1
