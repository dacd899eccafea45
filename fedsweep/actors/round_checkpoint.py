"""A run's round checkpoints on disk (:class:`RoundCheckpoints`, the client fleet's): the files of a
round (the client actors', whose answers to ``save`` the fleet collects, and the server's state), the
round's record in the journal beside the round folders (:meth:`RoundCheckpoints.seal`), and only
then the round committed atomically — at once, or, with ``checkpoint.overlap``, on a writer thread
once every file is on disk while the next round trains (:class:`DeferredRound`). A committed round
therefore always has its record: a driver that dies before logging it finds it there when the run
resumes.

This object calls no actor: it waits on the object refs the fleet hands it. Where an actor died
before its deferred files were written, :meth:`RoundCheckpoints.wait_deferred` says which, and the
fleet brings it back, has it write them again and hands the digests back
(:meth:`RoundCheckpoints.commit_rewritten`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray

from fedsweep import checkpoint as ckpt
from fedsweep.actors.actor_health import died
from fedsweep.actors.client_state import write_files
from fedsweep.errors import one_line


@dataclass
class DeferredRound:
    """A round whose checkpoint is being written while the next one trains (``checkpoint.overlap``)."""

    rnd: int
    stage: Any
    previous: str | None
    calls: list[tuple[int, list[int], list]]
    """Its answered training calls (the fleet's): replayed by an actor that must write its files again."""
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
    """Set once the round thread waits for the commit (:meth:`RoundCheckpoints.wait_deferred`)."""


class FilesLost(Exception):
    """Client actors (``indexes``) died before their files of deferred round ``round`` were on disk;
    ``known``: the digests of every other file of the round."""

    def __init__(self, indexes: list[int], known: dict[str, dict], d: DeferredRound):
        super().__init__(f"client actors {indexes} died before their checkpoint files were written")
        self.indexes, self.known, self.round = indexes, known, d


class RoundCheckpoints:
    """The round checkpoints of a run under ``root``: what was last committed (``last_committed``, the
    round folder; ``committed_round``), the round being written while the next one trains, and the
    writer thread. ``before_commit(rnd, asked, timeout)``: called on the writer thread before a deferred
    round is committed (the fleet's probe)."""

    def __init__(self, root: Path, cfg, timeout: float, last_committed: Path | None, committed_round: int,
                 before_commit: Callable[[int, threading.Event, float], None] | None = None):
        self.root, self.cfg, self.timeout, self.before_commit = root, cfg, timeout, before_commit
        self.last_committed = last_committed  # the source clients reuse unchanged files from
        self.committed_round = committed_round
        self._deferred: DeferredRound | None = None
        self._staged: tuple[int, dict[str, dict]] | None = None  # a round written at once, not yet sealed
        self._lock = threading.Lock()
        self._write_pool: ThreadPoolExecutor | None = None

    def defers(self, rnd: int) -> bool:
        """Whether round ``rnd``'s files are written while the next round trains (``checkpoint.overlap``;
        never the last round, nor sharded clients)."""
        return self.cfg.checkpoint.overlap and rnd < self.cfg.rounds and self.cfg.clients.shards == 1

    def stage(self, rnd: int) -> tuple[Path, str | None]:
        """Round ``rnd``'s staging folder and the committed round its clients may reuse files from."""
        previous = str(self.last_committed) if self.last_committed is not None else None
        return ckpt.staging_dir(self.root, rnd), previous

    def written(self, rnd: int, stage: Path, previous: str | None, state, acks: list[dict], refs: list,
                calls: list[tuple[int, list[int], list]]) -> None:
        """Round ``rnd``'s client files are written (``acks``: each actor's answer to ``save``) or being
        written (``refs``: each actor's ``saved``, None where it saved at once): write the server's
        ``state`` beside them, at once or on the writer thread; the round is committed once sealed
        (:meth:`seal`). ``calls``: the round's answered training calls, for an actor that must write again."""
        server_files = [(stage / "server.safetensors", ckpt.tensor_chunks(ckpt.server_state_tensors(state))),
                        (stage / "server.json", [ckpt.json_bytes({"round": rnd, "algorithm": state.meta})])]
        if not self.defers(rnd):
            known = {name: entry for s in acks for name, entry in s["files"].items()}
            self._staged = (rnd, {**known, **write_files(server_files)})
            return
        d = DeferredRound(rnd, stage, previous, list(calls), acks, refs)
        d.committed = self._writer().submit(self._commit_when_written, d, server_files)
        with self._lock:
            self._deferred = d

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
        with self._lock:
            d = self._deferred
        if d is None or d.rnd != rnd:
            raise RuntimeError(f"round {rnd} has no checkpoint to seal")
        d.record = record
        d.sealed.set()

    def wait_deferred(self) -> FilesLost | None:
        """Wait until the round written while this one trained is committed (None; also where there is
        none), or say which actors died before their files were on disk (the caller has them written
        again, then :meth:`commit_rewritten`)."""
        with self._lock:
            d, self._deferred = self._deferred, None
        if d is None:
            return None
        d.asked.set()
        try:
            d.committed.result(timeout=self.timeout)
        except FilesLost as lost:
            return lost
        return None

    def commit_rewritten(self, d: DeferredRound, known: dict[str, dict]) -> None:
        """Deferred round ``d`` committed with the digests of every file, those written again included."""
        self._commit_sealed(d, known)

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
        actors died before theirs were (the fleet has them written again)."""
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
            raise FilesLost(lost, known, d)
        self._commit_sealed(d, known)

    def _commit_sealed(self, d: DeferredRound, known: dict[str, dict]) -> None:
        """Deferred round ``d`` committed once its record is there: the record into the journal, then
        the commit."""
        if not d.sealed.wait(self.timeout):
            raise RuntimeError(f"round {d.rnd} was never sealed with its record: not committed")
        if self.before_commit is not None:
            self.before_commit(d.rnd, d.asked, self.timeout)
        ckpt.write_record(self.root, d.rnd, d.record)
        self._commit(d.rnd, known)
