"""The client fleet (:class:`ClientFleet`): the server's client actors and everything about their lives.

The server asks the fleet to :meth:`~ClientFleet.train`, :meth:`~ClientFleet.evaluate`,
:meth:`~ClientFleet.checkpoint`, :meth:`~ClientFleet.seal` and :meth:`~ClientFleet.flush`; the fleet
makes the calls (an actor's clients of a round in a few calls, ``actors.call_plan``), retries what
failed, and keeps every actor's state where the server believes it to be. It owns the round
checkpoints (``actors.round_checkpoint``) and calls nothing of the server's.

Exactly-once rounds. A client actor that dies is restarted by Ray and comes back with the state it
was constructed with, which undoes this round's training of clients whose results the server already
holds. Whenever the fleet sees a new incarnation of an actor it *adopts* it:

1. the round written while this one trained is committed first (an actor that died before writing
   its files of it is brought back to that round and writes them again);
2. the life is *rewound* to the last committed round (``ClientActor.rewind``; as built where none is),
   whatever it trained before it was adopted (a probe that found it restarting misses it, and the
   round's calls reach it first), under a new token: what it answered before is asked for again;
3. this round's training calls of every client it hosts are *replayed* in order with the same
   payloads — client randomness is a function of (seed, round, client), so the replay rebuilds
   bitwise what was lost — and only then is what failed retried.

Results already received are kept. The fleet sees a new incarnation in a failed call, in the one
probe at the start of a round, and in the incarnation token every answer (training, evaluation,
checkpoint) carries: an answer from a life not yet adopted is set aside, the life adopted, and the
call made again.

The recovery tests inject their faults through the fleet's probe (``actors.probe``): the round's
clients trained, nothing aggregated yet (``round_trained``), and a deferred round's commit held.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import ray

from fedsweep.actors.actor_health import await_actor
from fedsweep.actors.call_plan import TRAIN_CALLS_PER_ACTOR, evaluation_groups, training_calls
from fedsweep.actors.probe import NO_PROBE, Probe
from fedsweep.actors.progress import Progress
from fedsweep.actors.round_checkpoint import DeferredRound, RoundCheckpoints
from fedsweep.algorithms.tensors import tensor_bytes
from fedsweep.algorithms.types import ClientResult, Payload, payload_bytes
from fedsweep.errors import one_line

Call = tuple[int, list[int], list]
"""An answered training call: (actor index, the clients it trained, their payloads' object refs)."""


class ClientFleet:
    """The client ``actors`` (clients placed by ``assignment``), each call answered within ``timeout``
    seconds. It knows each actor's adopted incarnation, the lives adopted away, this round's answered
    training calls and retried clients. ``checkpoints``: the run's round checkpoints (None: no round is
    kept, and a new life is rewound to how it was built); ``calls_per_actor``: training calls per actor
    and round; ``probe``: the recovery tests' (``actors.probe``)."""

    def __init__(self, actors: list, assignment: dict[int, int], timeout: float, progress: Progress,
                 checkpoints: RoundCheckpoints | None = None, calls_per_actor: int = TRAIN_CALLS_PER_ACTOR,
                 probe: Probe = NO_PROBE):
        self.actors, self.assignment, self.timeout = actors, {int(k): v for k, v in assignment.items()}, timeout
        self.progress, self.checkpoints, self.calls_per_actor, self.probe = progress, checkpoints, calls_per_actor, probe
        self.known: dict[int, str] = {}
        self.former: set[str] = set()  # incarnation tokens of lives adopted away
        self.undone: set[str] = set()
        """Tokens of lives rewound as they were adopted: what they answered before, computed on the state
        the rewind undid, is asked for again."""
        self.round_calls: list[Call] = []
        """This round's answered training calls, in the order they were answered."""
        self.retried: dict[int, str] = {}
        self.partial_sums = False  # whether this round's training calls ask for partial sums
        self.traffic_bytes = 0
        """Tensor bytes this round's calls moved between the server and its client actors, both ways."""
        self._finishing = threading.RLock()  # one thread at a time finishes a deferred round

    @classmethod
    def for_run(cls, cfg, actors: list, assignment: dict[int, int], root, last_committed, committed_round: int,
                progress: Progress, probe: Probe = NO_PROBE) -> "ClientFleet":
        """The fleet of a run of ``cfg``, its rounds committed under ``root`` (``last_committed``: the round
        folder it starts from, None for a fresh run); its incarnations learned."""
        timeout = cfg.server.call_timeout_s
        checkpoints = RoundCheckpoints(root, cfg, timeout, last_committed, committed_round, probe.before_commit)
        grouped = cfg.batch_plan().clients > 1  # one training call per actor where its clients train in groups
        fleet = cls(actors, assignment, timeout, progress, checkpoints, 1 if grouped else TRAIN_CALLS_PER_ACTOR, probe)
        fleet.known = {i: inc["token"] for i, inc in fleet._incarnations().items() if inc is not None}
        return fleet

    # ------------------------------------------------------------------ a round
    def begin_round(self, rnd: int) -> None:
        """A round starts: every actor probed, any that restarted since it was last seen adopted."""
        self.round_calls, self.retried, self.traffic_bytes = [], {}, 0
        for i, inc in self._incarnations().items():
            try:
                self._adopt(i, inc, rnd, "restarted before the round")
            except Exception:  # gone for good: its clients fail in the next call and are left out
                pass

    def end_round(self) -> dict[str, Any]:
        """The round's clients retried (by client, why) and tensor bytes moved; the fleet's round forgotten."""
        out = {"retried": dict(self.retried), "traffic_bytes": self.traffic_bytes}
        self.round_calls, self.retried, self.traffic_bytes = [], {}, 0
        return out

    def train(self, rnd: int, payloads: dict[int, Payload], on_answer: Callable[[Any], Any] | None = None,
              partial_sums: bool = False) -> tuple[dict, dict]:
        """The round's local training of every client of ``payloads``; (results, failures).
        ``on_answer`` takes each result as its call answers, while the other calls still train (the
        server's chain: decode, measure), and each call's partial sum (a dict) where ``partial_sums`` asks
        the actors for them (``ClientActor.train_many``)."""
        out = self._train_all(rnd, payloads, "train", on_answer, partial_sums)
        self.probe.round_trained(rnd)
        return out

    def final_update(self, rnd: int, payloads: dict[int, Payload]) -> tuple[dict, dict]:
        """The method's one more local update after the last round (``final_payloads``); (results, failures)."""
        return self._train_all(rnd, payloads, "final update")

    def uploads(self, rnd: int, cids: list[int]) -> dict[int, Any]:
        """The upload parameters of ``cids`` as they trained this round, from their actors (where the actors
        sent partial sums: ``ClientActor.uploads``)."""
        mine: dict[int, list[int]] = {}
        for cid in cids:
            mine.setdefault(self.assignment[cid], []).append(cid)
        out: dict[int, Any] = {}
        for index, own in mine.items():
            out.update(ray.get(self.actors[index].uploads.remote(rnd, own), timeout=self.timeout))
        return out

    def evaluate(self, rnd: int, payloads: dict[int, Payload]) -> tuple[dict, dict]:
        """Evaluate every client with one call per client actor (``ClientActor.evaluate_many``), its
        clients grouped by the payload they share (``call_plan.evaluation_groups``). Returns (metrics by
        client, failures)."""
        groups = evaluation_groups(payloads, self.assignment)

        def launch(index, cids):  # always the actor's whole group: a retry follows a failed call
            self.traffic_bytes += sum(payload_bytes(p) for _, p in groups[index])
            return self.actors[index].evaluate_many.remote(rnd, groups[index])

        def received(index, answer) -> tuple[dict, dict]:
            token, metrics = answer
            if self._answered_too_early(index, token, rnd, "evaluation"):
                token, metrics = ray.get(launch(index, []), timeout=self.timeout)
            return metrics, {}

        calls = [(i, [cid for cids, _ in g for cid in cids]) for i, g in groups.items()]
        return self._gather(calls, launch, received, rnd, "evaluate")

    # ------------------------------------------------------------- checkpoints
    @property
    def committed_round(self) -> int:
        return self.checkpoints.committed_round

    def defers(self, rnd: int) -> bool:
        """Whether round ``rnd``'s files are written while the next round trains (``checkpoint.overlap``)."""
        return self.checkpoints.defers(rnd)

    def checkpoint(self, rnd: int, state) -> int:
        """Round ``rnd`` written (every actor's clients, the server's ``state``), the round before committed
        first; committed once sealed with its record (:meth:`seal`). Returns how many clients' files were
        reused unchanged."""
        self.finish_deferred()  # the previous round's files, written while this round trained
        stage, previous = self.checkpoints.stage(rnd)
        defer = self.checkpoints.defers(rnd)
        refs = [a.save.remote(str(stage), previous, defer) for a in self.actors]
        acks = [self._saved(i, ref, str(stage), previous, rnd) for i, ref in enumerate(refs)]
        written = [self.actors[i].saved.remote(str(stage)) if defer and a.get("deferred") else None
                   for i, a in enumerate(acks)]
        self.checkpoints.written(rnd, stage, previous, state, acks, written, self.round_calls)
        return sum(len(a["reused"]) for a in acks)

    def seal(self, rnd: int, record: dict) -> None:
        """Round ``rnd``'s record into the journal, then the round committed (``RoundCheckpoints.seal``)."""
        self.checkpoints.seal(rnd, record)

    def flush(self) -> int:
        """Commit a deferred round now (the run stops); the last committed round."""
        self.finish_deferred()
        return self.checkpoints.committed_round

    def finish_deferred(self) -> None:
        """Make sure the round whose files were written while this one trained is committed (no-op if
        none). A client actor that died before its files were on disk is brought back to the end of that
        round and writes them again, and then the round is committed."""
        if self.checkpoints is None:
            return
        with self._finishing:
            lost = self.checkpoints.wait_deferred()
            if lost is None:
                return
            known = dict(lost.known)
            for i in lost.indexes:
                if not self._await(i):
                    raise RuntimeError(f"round {lost.round.rnd}'s checkpoint: client actor {i} died before its "
                                       "files were written and does not come back") from None
                known.update(self._write_again(i, lost.round)["files"])
            self.checkpoints.commit_rewritten(lost.round, known)

    def _saved(self, i: int, ref, stage: str, previous: str | None, rnd: int) -> dict:
        """Actor ``i``'s answer to ``save``; an actor that died while saving, or whose new life saved the
        state it was built with, is brought back to this round and saves again, synchronously."""
        try:
            ack = ray.get(ref, timeout=self.timeout)
        except Exception as exc:  # died while saving: recover its clients' state, save again
            if not self._await(i):
                raise
            self._recover(i, rnd, f"checkpoint: {type(exc).__name__}")
            return ray.get(self.actors[i].save.remote(stage, previous), timeout=self.timeout)
        if self._answered_too_early(i, ack["token"], rnd, "the checkpoint"):
            return ray.get(self.actors[i].save.remote(stage, previous), timeout=self.timeout)
        return ack

    def _write_again(self, index: int, d: DeferredRound) -> dict[str, Any]:
        """Actor ``index`` was restarted before round ``d.rnd``'s files of its clients were written:
        bring them back to the end of that round (the committed round before it, then that round's
        training calls replayed) and save them synchronously. The incarnation is left to be adopted for
        the round in progress (its probe or its next failed call replays that round)."""
        inc = ray.get(self.actors[index].incarnation.remote(), timeout=min(self.timeout, 600.0))
        if inc["token"] == d.acks[index].get("token"):
            raise RuntimeError(f"round {d.rnd}'s checkpoint: client actor {index} lost its files but did not restart")
        self._rewind(index)
        self._replay(index, d.rnd, d.calls, f"its round-{d.rnd} checkpoint files were lost")
        return ray.get(self.actors[index].save.remote(str(d.stage), d.previous), timeout=self.timeout)

    # ------------------------------------------------------------------- lives
    def _incarnations(self) -> dict[int, dict[str, Any] | None]:
        """Every actor's incarnation, probed concurrently (None: it does not answer)."""
        refs = {i: a.incarnation.remote() for i, a in enumerate(self.actors)}
        out: dict[int, dict[str, Any] | None] = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref, timeout=min(self.timeout, 600.0))
            except Exception:
                out[i] = None
        return out

    def _adopt(self, index: int, inc: dict[str, Any] | None, rnd: int, reason: str) -> None:
        """A new incarnation of actor ``index`` brought to where this round stands (no-op otherwise): the
        deferred round committed, the life rewound under a new token (what it answered so far is
        undone), this round's training calls replayed."""
        if inc is None or inc["token"] == self.known.get(index):
            return
        self.finish_deferred()
        self.undone.add(inc["token"])
        token = self._rewind(index)
        if index in self.known:
            self.former.add(self.known[index])
        self.known[index] = token
        self._replay(index, rnd, self.round_calls, reason)

    def _rewind(self, index: int) -> str:
        """Actor ``index`` back to the last committed round (as built where none is committed:
        ``ClientActor.rewind``), whatever the life did before; its new token."""
        last = self.checkpoints.last_committed if self.checkpoints is not None else None
        folder = str(last) if last is not None else None
        return ray.get(self.actors[index].rewind.remote(folder), timeout=self.timeout)["token"]

    def _replay(self, index: int, rnd: int, calls: list[Call], reason: str) -> None:
        """Make actor ``index``'s training calls among ``calls`` again, each with the clients it trained:
        the same calls group the same clients together (``train.batch_clients``), and client randomness
        is a function of (seed, round, client), so the same state comes back, bitwise."""
        for i, cids, refs in calls:
            if i != index:
                continue
            distinct = list(dict.fromkeys(refs))
            items = [(cid, distinct.index(ref)) for cid, ref in zip(cids, refs)]
            extra = {"partial_sum": True} if self.partial_sums else {}  # (the actor keeps the uploads again)
            _, answers = ray.get(self.actors[index].train_many.remote(rnd, items, *distinct, **extra),
                                 timeout=self.timeout)[:2]
            failed = [(cid, why) for cid, why in answers if isinstance(why, str)]
            if failed:
                raise RuntimeError(f"replaying client {failed[0][0]}'s training failed: {failed[0][1]}")
            self.retried.update(dict.fromkeys(cids, f"replayed after a restart of its actor ({reason})"))

    def _recover(self, index: int, rnd: int, reason: str) -> None:
        """Actor ``index`` answers again after a failure: adopt it if it is a new incarnation."""
        self._adopt(index, ray.get(self.actors[index].incarnation.remote(), timeout=min(self.timeout, 600.0)),
                    rnd, reason)

    def _answered_too_early(self, index: int, token: str, rnd: int, phase: str) -> bool:
        """Whether an answer of actor ``index`` carrying incarnation ``token`` must be asked for again: it
        came from a life the fleet had not adopted (restarted between calls, unprobed: adopted now), or
        from one rewound as it was adopted; either computed it on state the rewind undid. An answer from
        a life adopted away since (its call began before) is not: the caller replays what it trained."""
        if token == self.known.get(index) or token in self.former:
            return False
        if token not in self.undone:
            self._recover(index, rnd, f"restarted before {phase}")
        return True

    def _await(self, index: int) -> bool:
        return await_actor(self.actors[index], sorted(c for c, a in self.assignment.items() if a == index), index)

    # ------------------------------------------------------------------- calls
    def _train_all(self, rnd: int, payloads: dict[int, Payload], phase: str,
                   on_answer: Callable[[Any], Any] | None = None, partial_sums: bool = False) -> tuple[dict, dict]:
        """Train every client of ``payloads`` in a few calls per actor (``call_plan.training_calls``); a
        call that fails is retried once, and so is a client whose training raised."""
        self.partial_sums = partial_sums
        refs: dict[int, ray.ObjectRef] = {}
        by_id: dict[int, ray.ObjectRef] = {}
        sizes: dict[ray.ObjectRef, int] = {}
        for cid, p in payloads.items():  # one put per distinct payload object
            if id(p) not in by_id:  # (not setdefault: its default, a put, would be made for every client)
                by_id[id(p)] = ray.put(p)
                sizes[by_id[id(p)]] = payload_bytes(p)
            refs[cid] = by_id[id(p)]

        def launch(index, cids):
            distinct = list(dict.fromkeys(refs[cid] for cid in cids))  # Ray resolves top-level refs only
            items = [(cid, distinct.index(refs[cid])) for cid in cids]
            self.traffic_bytes += sum(sizes[ref] for ref in distinct)
            if partial_sums:
                return self.actors[index].train_many.remote(rnd, items, *distinct, partial_sum=True)
            return self.actors[index].train_many.remote(rnd, items, *distinct)

        def received(index, answer) -> tuple[dict, dict]:
            return self._received_training(index, answer, rnd, phase, refs, on_answer)

        return self._gather(training_calls(list(payloads), self.assignment, self.calls_per_actor), launch,
                            received, rnd, phase)

    def _received_training(self, index: int, answer, rnd: int, phase: str, refs: dict,
                           on_answer: Callable[[Any], Any] | None) -> tuple[dict, dict]:
        """A training call's answer: its results handed to ``on_answer`` (and its partial sum), the call
        recorded for a replay; what a life not yet adopted answered is asked for again, what a life
        adopted away since trained is replayed on the current one."""
        token, answers, partial = answer if len(answer) == 3 else (*answer, None)
        results, errors = {}, {}
        if self._answered_too_early(index, token, rnd, phase):  # these clients train again, alone
            return {}, {cid: "answered by a restarted actor before it was brought back" for cid, _ in answers}
        if partial is not None:
            self.traffic_bytes += tensor_bytes(partial["sum"])
        for cid, result in answers:
            if isinstance(result, str):
                errors[cid] = result
                continue
            self.traffic_bytes += tensor_bytes(result.upload.params) + tensor_bytes(result.upload.tensors)
            results[cid] = on_answer(result) if on_answer is not None else result
            loss = result.metrics.get("train_loss")
            if loss is not None:
                self.progress.set(loss=loss)
        call = (index, list(results), [refs[cid] for cid in results])
        if results and self.known.get(index, token) != token:  # trained by a life adopted away since
            self._replay(index, rnd, [call], "its result came from the actor's previous life")
        if results:
            self.round_calls.append(call)
        if partial is not None and on_answer is not None:
            on_answer(partial)
        return results, errors

    def _gather(self, calls: list[tuple[int, list[int]]], launch, received, rnd: int, phase: str) -> tuple[dict, dict]:
        """Make every call (``(actor index, its clients)``; ``launch(index, clients)`` makes it) and
        collect the answers as they come (``received(index, answer)`` -> (results by client, errors by
        client)). A call that fails is retried once after its actor answers again (a restarted actor
        first gets back this round's state); a client whose answer is an error is retried once alone;
        what fails again fails each of its clients with the reason."""
        self.progress.set(phase=phase, done=0, total=sum(len(cids) for _, cids in calls), round=rnd)
        pending = {launch(index, cids): (index, cids, 0) for index, cids in calls}
        results, failures = {}, {}
        deadline = time.monotonic() + self.timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for ref, (_, cids, _) in pending.items():
                    failures.update(dict.fromkeys(cids, f"no answer within server.call_timeout_s={self.timeout:g}s"))
                    ray.cancel(ref, force=False)
                break
            ref = ready[0]
            index, cids, attempt = pending.pop(ref)
            try:
                answer = ray.get(ref, timeout=self.timeout)
            except Exception as exc:  # actor died or the call raised
                reason = one_line(exc)
                what = f"client {cids[0]}" if len(cids) == 1 else f"clients {cids[0]}..{cids[-1]}"
                if attempt == 0 and self._await(index):
                    try:  # a restarted actor first gets back this round's state of all its clients
                        self._recover(index, rnd, f"{phase} of {what}: {reason}")
                    except Exception as again:
                        failures.update(dict.fromkeys(cids, f"{reason}; recovery failed: {type(again).__name__}"))
                        continue
                    self.retried.update(dict.fromkeys(cids, f"{phase} retried: {reason}"))
                    pending[launch(index, cids)] = (index, cids, 1)
                    continue
                failures.update(dict.fromkeys(cids, reason))
                continue
            got, errors = received(index, answer)
            results.update(got)
            for cid, reason in errors.items():
                if attempt == 0:
                    self.retried[cid] = f"{phase} retried: {reason}"
                    pending[launch(index, [cid])] = (index, [cid], 1)
                else:
                    failures[cid] = reason
            self.progress.add_done(len(got))
        return results, failures
