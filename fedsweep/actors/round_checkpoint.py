"""The server's round checkpoints (:class:`RoundCheckpoints`, a collaborator of ``ServerActor``): every client actor saves its clients,
the server its state (:meth:`RoundCheckpoints.checkpoint`), the round's record goes into the journal
beside the round folders (:meth:`RoundCheckpoints.seal`), and only then is the round committed
atomically — at once, or, with ``checkpoint.overlap``, on the server's writer thread once every file
is on disk while the next round trains (:class:`DeferredRound`); an actor that died before writing is
brought back to that round and writes again. A committed round therefore always has its record: a
driver that dies before logging it finds it there when the run resumes."""

from __future__ import annotations

import threading
from pathlib import Path
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from fedsweep import checkpoint as ckpt
from fedsweep.actors.client_calls import ClientCalls, died
from fedsweep.actors.client_state import write_files
from fedsweep.errors import one_line


@dataclass
class DeferredRound:
    """A round whose checkpoint is being written while the next one trains (``checkpoint.overlap``)."""

    rnd: int
    stage: Any
    previous: str | None
    calls: list[tuple[int, list[int], list]]
    """Its answered training calls (``ClientCalls.round_calls``): replayed by an actor that must write
    its files again."""
    acks: list[dict[str, Any]]
    """Each client actor's answer to ``save``."""
    refs: list
    """Per client actor, ``ClientActor.saved`` (None: it saved synchronously)."""
    committed: Future | None = None
    """:meth:`RoundCheckpoints._commit_when_written`, on the writer thread."""
    record: dict | None = None
    """The round's record (:meth:`RoundCheckpoints.seal`): the commit waits for it."""
    sealed: threading.Event = field(default_factory=threading.Event)
    asked: threading.Event = field(default_factory=threading.Event)
    """Set once the round thread waits for the commit (:meth:`RoundCheckpoints.finish_deferred`)."""


class FilesLost(Exception):
    """Client actors (``indexes``) died before their files of a deferred round were on disk; ``known``:
    the digests of every other file of the round."""

    def __init__(self, indexes: list[int], known: dict[str, dict]):
        super().__init__(f"client actors {indexes} died before their checkpoint files were written")
        self.indexes, self.known = indexes, known


class RoundCheckpoints:
    """The round checkpoints of a run under ``root``: what was last committed (``last_committed``, the
    round folder; ``committed_round``), the round being written while the next one trains, and the
    writer thread. Recovery of an actor that dies while saving goes through the server's
    :class:`~fedsweep.actors.client_calls.ClientCalls`, passed to each call that may need it.
    ``faults``: the recovery tests' fault points (``actors.faults``), None in a run."""

    def __init__(self, actors: list, root: Path, cfg, timeout: float, last_committed: Path | None,
                 committed_round: int, faults=None):
        self.actors, self.root, self.cfg, self.timeout, self.faults = actors, root, cfg, timeout, faults
        self.last_committed = last_committed  # the source clients reuse unchanged files from
        self.committed_round = committed_round
        self._deferred: DeferredRound | None = None
        self._staged: tuple[int, dict[str, dict]] | None = None  # a round written at once, not yet sealed
        self._deferred_lock = threading.RLock()
        self._write_pool: ThreadPoolExecutor | None = None

    def checkpoint(self, rnd: int, state, calls: ClientCalls) -> int:
        """Write round ``rnd`` (client actors' files, the server's ``state``): at once, or, deferred,
        on the writer threads while the next round trains; it is committed once sealed with its record
        (:meth:`seal`) and, deferred, its files are on disk (:meth:`finish_deferred`). Returns how many
        clients' files were reused unchanged."""
        previous = self.last_committed
        stage = ckpt.staging_dir(self.root, rnd)
        prev = str(previous) if previous is not None else None
        defer = self.defers(rnd)
        refs = [a.save.remote(str(stage), prev, defer) for a in self.actors]
        saved = []
        for i, ref in enumerate(refs):
            try:
                ack = ray.get(ref, timeout=self.timeout)
            except Exception as exc:  # died while saving: recover its clients' state, save again
                if not calls.await_actor(i):
                    raise
                calls.recover(i, rnd, f"checkpoint: {type(exc).__name__}")
                ack = ray.get(self.actors[i].save.remote(str(stage), prev), timeout=self.timeout)
            else:
                if calls.adopted_before(i, ack["token"], rnd, "the checkpoint"):  # it saved its first state
                    ack = ray.get(self.actors[i].save.remote(str(stage), prev), timeout=self.timeout)
            saved.append(ack)
        server_files = [(stage / "server.safetensors", ckpt.tensor_chunks(ckpt.server_state_tensors(state))),
                        (stage / "server.json", [ckpt.json_bytes({"round": rnd, "algorithm": state.meta})])]
        if not defer:
            known = {name: entry for s in saved for name, entry in s["files"].items()}
            self._staged = (rnd, {**known, **write_files(server_files)})
        else:
            refs = [self.actors[i].saved.remote(str(stage)) if s.get("deferred") else None for i, s in enumerate(saved)]
            d = DeferredRound(rnd, stage, prev, list(calls.round_calls), saved, refs)
            d.committed = self._writer().submit(self._commit_when_written, d, server_files)
            with self._deferred_lock:
                self._deferred = d
        return sum(len(s["reused"]) for s in saved)

    def seal(self, rnd: int, record: dict) -> None:
        """Round ``rnd``'s record into the journal (``checkpoint.write_record``), then the round committed:
        now where it was written at once, on the writer thread once its files are on disk where it was
        deferred."""
        if self._staged is not None and self._staged[0] == rnd:
            _, known = self._staged
            self._staged = None
            ckpt.write_record(self.root, rnd, record)
            self._commit(rnd, known)
            return
        with self._deferred_lock:
            d = self._deferred
        if d is None or d.rnd != rnd:
            raise RuntimeError(f"round {rnd} has no checkpoint to seal")
        d.record = record
        d.sealed.set()

    def defers(self, rnd: int) -> bool:
        """Whether round ``rnd``'s files are written while the next round trains (``checkpoint.overlap``;
        never the last round, nor sharded clients)."""
        return self.cfg.checkpoint.overlap and rnd < self.cfg.rounds and self.cfg.clients.shards == 1

    def _commit(self, rnd: int, known: dict[str, dict]) -> None:
        self.last_committed = ckpt.commit(self.root, rnd, self.cfg.checkpoint.keep, known)
        self.committed_round = rnd

    def _writer(self) -> ThreadPoolExecutor:
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        return self._write_pool

    def _commit_when_written(self, d: DeferredRound, server_files: list) -> None:
        """On the writer thread: write the server's files of round ``d.rnd``, wait for every client
        actor's, and commit the round as soon as they are all on disk. Raises :class:`FilesLost` when
        actors died before theirs were (the round thread writes them again)."""
        known = write_files(server_files)
        lost = []
        for i, (ack, ref) in enumerate(zip(d.acks, d.refs)):
            if ref is None:  # this actor wrote synchronously (a retried save)
                known.update(ack["files"])
                continue
            try:
                known.update(ray.get(ref, timeout=self.timeout)["files"])
            except Exception as exc:
                if not died(exc):
                    raise RuntimeError(f"round {d.rnd}'s checkpoint could not be written: {one_line(exc)}") from None
                lost.append(i)
        if lost:
            raise FilesLost(lost, known)
        self._commit_sealed(d, known)

    def _commit_sealed(self, d: DeferredRound, known: dict[str, dict]) -> None:
        """Deferred round ``d`` committed once its record is there: the record into the journal, then
        the commit."""
        if not d.sealed.wait(self.timeout):
            raise RuntimeError(f"round {d.rnd} was never sealed with its record: not committed")
        if self.faults is not None:  # the recovery tests' hold_commit holds the commit here
            self.faults.hold_commit(d, self.timeout)
        ckpt.write_record(self.root, d.rnd, d.record)
        self._commit(d.rnd, known)

    def finish_deferred(self, calls: ClientCalls) -> None:
        """Make sure the round whose files were written while this one trained is committed (no-op if
        none). A client actor that died before its files were on disk writes them again
        (:meth:`_write_again`), and then the round is committed."""
        with self._deferred_lock:
            d, self._deferred = self._deferred, None
            if d is None:
                return
            d.asked.set()
            try:
                d.committed.result(timeout=self.timeout)
            except FilesLost as lost:
                known = dict(lost.known)
                for i in lost.indexes:
                    if not calls.await_actor(i):
                        raise RuntimeError(f"round {d.rnd}'s checkpoint: client actor {i} died before its "
                                           "files were written and does not come back") from None
                    known.update(self._write_again(i, d, calls)["files"])
                self._commit_sealed(d, known)

    def flush(self, calls: ClientCalls) -> int:
        """Commit a deferred round now (the run stops); the last committed round."""
        self.finish_deferred(calls)
        return self.committed_round

    def restore_committed(self, index: int) -> dict[str, Any]:
        """Actor ``index`` back to the last committed round (as it was built where none is committed:
        ``ClientActor.rewind``), whatever the life did before: it may have answered calls before the
        server adopted it (the round's probe missed it while Ray restarted it), and what they trained
        is not the committed state. Returns its incarnation after the rewind (a new token)."""
        folder = str(self.last_committed) if self.last_committed is not None else None
        return ray.get(self.actors[index].rewind.remote(folder), timeout=self.timeout)

    def _write_again(self, index: int, d: DeferredRound, calls: ClientCalls) -> dict[str, Any]:
        """Actor ``index`` was restarted before round ``d.rnd``'s files of its clients were written:
        bring them back to the end of that round (the committed round before it, then that round's
        training calls replayed, as :meth:`ClientCalls.adopt` does) and save them synchronously. The
        incarnation is left to be adopted for the round in progress (``sync``/``recover`` replay that
        round)."""
        inc = ray.get(self.actors[index].incarnation.remote(), timeout=min(self.timeout, 600.0))
        if inc["token"] == d.acks[index].get("token"):
            raise RuntimeError(f"round {d.rnd}'s checkpoint: client actor {index} lost its files but did not restart")
        self.restore_committed(index)
        calls.replay(index, d.rnd, d.calls, f"its round-{d.rnd} checkpoint files were lost")
        return ray.get(self.actors[index].save.remote(str(d.stage), d.previous), timeout=self.timeout)
