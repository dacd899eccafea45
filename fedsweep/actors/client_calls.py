"""The server's calls to its client actors, with recovery (:class:`ClientCalls`, a collaborator of
``ServerActor``).

Training calls: an actor's clients of a round in a few calls (:func:`training_calls`); evaluation:
one call per actor, clients grouped by the payload they share (:func:`evaluation_groups`). A call
that fails is retried once after its actor answers again; a restarted actor is first brought back to
where the round stands (the last committed round, then this round's training calls replayed)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import ray

from fedsweep.algorithms.tensors import tensor_bytes
from fedsweep.algorithms.types import ClientResult, Payload, payload_bytes
from fedsweep.errors import one_line


TRAIN_CALLS_PER_ACTOR = 4
"""A round trains an actor's clients in at most this many calls (``ClientActor.train_many``): a call
per client costs a Ray round trip and a payload fetch each (at K=50 most of a round's overhead),
one call per actor would leave the progress line still until the actor is done."""


def training_calls(cids: list[int], assignment: dict[int, int], per_actor: int = TRAIN_CALLS_PER_ACTOR) -> list[tuple[int, list[int]]]:
    """``cids`` (in training order) as ``[(actor index, clients)]``: each actor's clients cut, in order,
    into at most ``per_actor`` consecutive runs whose sizes differ by at most one."""
    mine: dict[int, list[int]] = {}
    for cid in cids:
        mine.setdefault(assignment[cid], []).append(cid)
    calls = []
    for index, own in mine.items():
        n = min(per_actor, len(own))
        bounds = [len(own) * i // n for i in range(n + 1)]
        calls += [(index, own[a:b]) for a, b in zip(bounds, bounds[1:])]
    return calls


def evaluation_groups(payloads: dict[int, Payload], assignment: dict[int, int]) -> dict[int, list[tuple[list[int], Payload]]]:
    """Per client actor, its clients' evaluation payloads as ``[(clients, payload)]``: clients whose
    payloads carry the same parameter object and nothing else (a global model) form one group, so it
    is sent once and may be evaluated in shared batches; every other client is a group of its own."""
    out: dict[int, list[tuple[list[int], Payload]]] = {}
    shared: dict[tuple[int, int], list[int]] = {}
    for cid in sorted(payloads):
        p, index = payloads[cid], assignment[cid]
        if p.params is not None and p == Payload(params=p.params):  # only params set (compared by identity below)
            key = (index, id(p.params))
            if key not in shared:
                shared[key] = []
                out.setdefault(index, []).append((shared[key], p))
            shared[key].append(cid)
        else:
            out.setdefault(index, []).append(([cid], p))
    return out


def died(exc: BaseException) -> bool:
    """Whether a failed call means its actor's process is gone (or answers as a new incarnation)."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return True
    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, LookupError)


class Progress:
    """What the round is doing, for the driver's progress line (read while a round runs: a lock)."""

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


class ClientCalls:
    """The server's calls to ``actors`` (clients placed by ``assignment``), each answered within
    ``timeout`` seconds, with the recovery of actors that restarted. It owns what it knows of them:
    each actor's adopted incarnation, the lives adopted away, this round's answered training calls
    and retried clients. ``bring_back(index) -> incarnation``, the server's, runs when a
    restarted actor is adopted, before this round's calls are replayed on it: it rewinds the actor to
    the last committed round (the server asks its checkpoints; this class knows nothing of them) and
    returns the incarnation that leaves, a new token: calls the life answered before it was adopted
    (the round's probe missed it while Ray restarted it) ran on state the rewind undid, so their
    answers are asked for again (:attr:`undone`).
    ``calls_per_actor``: training calls per actor and round."""

    def __init__(self, actors: list, assignment: dict[int, int], timeout: float, progress: Progress,
                 bring_back=None, calls_per_actor: int = TRAIN_CALLS_PER_ACTOR):
        self.actors, self.assignment, self.timeout = actors, {int(k): v for k, v in assignment.items()}, timeout
        self.progress, self.bring_back, self.calls_per_actor = progress, bring_back, calls_per_actor
        self.known: dict[int, str] = {}
        self.former: set[str] = set()  # incarnation tokens of lives adopted away
        self.undone: set[str] = set()
        """Tokens of lives rewound as they were adopted: what they answered before, computed on the state
        the rewind undid, is asked for again."""
        self.round_calls: list[tuple[int, list[int], list]] = []
        """This round's answered training calls as ``(actor, clients trained, their payload refs)``, in
        the order they were answered."""
        self.retried: dict[int, str] = {}
        self.partial_sums = False  # whether this round's training calls ask for partial sums
        self.traffic_bytes = 0

    def meet(self) -> None:
        """Learn every actor's incarnation (at the server's start)."""
        self.known = {i: inc["token"] for i, inc in self.incarnations().items() if inc is not None}

    def begin_round(self) -> None:
        self.round_calls, self.retried = [], {}
        self.traffic_bytes = 0
        """Tensor bytes this round's calls moved between the server and its client actors, both ways (the
        payloads each call fetched, the uploads and partial sums each answered with)."""

    # ------------------------------------------------------------ actor recovery
    # Exactly-once rounds: a client actor that dies is restarted by Ray and comes back with the state
    # it was constructed with, which undoes this round's training of clients whose results the server
    # already holds. Whenever the server sees a new incarnation of an actor it adopts it: the actor is
    # rewound to the round the server last committed (whatever it trained before it was adopted: a
    # probe that found it restarting misses it, and the round's calls reach it first), under a new
    # token (its answers from before are asked for again), then this round's training calls of every client it
    # hosts are replayed in order with the same payloads — client randomness is a function of (seed,
    # round, client), so the replay rebuilds bitwise what was lost — and only then is what failed
    # retried. Results already received are kept. The server sees a new incarnation in a failed
    # call, in the one probe at the start of a round, and in the incarnation token every answer
    # (training, evaluation, checkpoint) carries: an answer from an incarnation not yet adopted is
    # set aside, the actor adopted, and the call made again (:meth:`adopted_before`).
    def incarnations(self) -> dict[int, dict[str, Any] | None]:
        """Every actor's incarnation, probed concurrently (None: it does not answer)."""
        refs = {i: a.incarnation.remote() for i, a in enumerate(self.actors)}
        out: dict[int, dict[str, Any] | None] = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref, timeout=min(self.timeout, 600.0))
            except Exception:
                out[i] = None
        return out

    def adopt(self, index: int, inc: dict[str, Any] | None, rnd: int, reason: str) -> None:
        """Bring a new incarnation of actor ``index`` to where this round stands (no-op otherwise)."""
        if inc is None or inc["token"] == self.known.get(index):
            return
        token = inc["token"]
        if self.bring_back is not None:  # rewound under a new token: what this life answered so far is undone
            token, undone = self.bring_back(index)["token"], token
            self.undone.add(undone)
        if index in self.known:
            self.former.add(self.known[index])
        self.known[index] = token
        self.replay(index, rnd, self.round_calls, reason)

    def replay(self, index: int, rnd: int, calls: list[tuple[int, list[int], list]], reason: str) -> None:
        """Make actor ``index``'s training calls among ``calls`` (``(actor, clients, payload refs)``, in
        the order they were answered) again, each with the clients it trained: the same calls group
        the same clients together (``train.batch_clients``), and client randomness is a function of
        (seed, round, client), so the same state comes back, bitwise."""
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

    def recover(self, index: int, rnd: int, reason: str) -> None:
        """Actor ``index`` answers again after a failure: adopt it if it is a new incarnation."""
        self.adopt(index, ray.get(self.actors[index].incarnation.remote(), timeout=min(self.timeout, 600.0)),
                   rnd, reason)

    def adopted_before(self, index: int, token: str, rnd: int, phase: str) -> bool:
        """Whether an answer of actor ``index`` carrying incarnation ``token`` must be asked for again: it
        came from a life of it the server had not adopted (restarted between calls, unprobed: adopted
        now), or from one rewound as it was adopted (:attr:`undone`); either computed it on state the
        rewind undid. An answer from a life adopted away since (its call began before) is not: the
        caller replays what it trained."""
        if token == self.known.get(index) or token in self.former:
            return False
        if token not in self.undone:
            self.recover(index, rnd, f"restarted before {phase}")
        return True

    def sync(self, rnd: int, phase: str) -> None:
        """Probe every actor; adopt any that restarted since it was last seen."""
        for i, inc in self.incarnations().items():
            try:
                self.adopt(i, inc, rnd, f"restarted before {phase}")
            except Exception:  # gone for good: its clients fail in the next call and are left out
                pass

    # ---------------------------------------------------------------------- calls
    def train_all(self, rnd: int, payloads: dict[int, Payload], phase: str,
                  on_answer: Callable[[ClientResult], ClientResult] | None = None,
                  partial_sums: bool = False) -> tuple[dict, dict]:
        """Train every client of ``payloads`` in a few calls per actor (:func:`training_calls`); a call
        that fails is retried once, and so is a client whose training raised. ``on_answer`` takes each
        result as its call answers, while the other calls still train (the server's chain: decode,
        measure), and each call's partial sum (a dict) where ``partial_sums`` asks the actors for them
        (``ClientActor.train_many``). Returns (results, failures)."""
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
            token, answers, partial = answer if len(answer) == 3 else (*answer, None)
            results, errors = {}, {}
            if self.adopted_before(index, token, rnd, phase):  # these clients train again, alone
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
                self.replay(index, rnd, [call], "its result came from the actor's previous life")
            if results:
                self.round_calls.append(call)
            if partial is not None and on_answer is not None:
                on_answer(partial)
            return results, errors

        return self.gather(training_calls(list(payloads), self.assignment, self.calls_per_actor), launch,
                           received, rnd, phase)

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

    def evaluate_all(self, rnd: int, payloads: dict[int, Payload]) -> tuple[dict, dict]:
        """Evaluate every client with one call per client actor (``ClientActor.evaluate_many``), its
        clients grouped by the payload they share (:func:`evaluation_groups`). Returns (metrics by
        client, failures)."""
        groups = evaluation_groups(payloads, self.assignment)

        def launch(index, cids):  # always the actor's whole group: a retry follows a failed call
            self.traffic_bytes += sum(payload_bytes(p) for _, p in groups[index])
            return self.actors[index].evaluate_many.remote(rnd, groups[index])

        def received(index, answer) -> tuple[dict, dict]:
            token, metrics = answer
            if self.adopted_before(index, token, rnd, "evaluation"):
                token, metrics = ray.get(launch(index, []), timeout=self.timeout)
            return metrics, {}

        calls = [(i, [cid for cids, _ in g for cid in cids]) for i, g in groups.items()]
        return self.gather(calls, launch, received, rnd, "evaluate")

    def gather(self, calls: list[tuple[int, list[int]]], launch, received, rnd: int, phase: str) -> tuple[dict, dict]:
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
                if attempt == 0 and self.await_actor(index):
                    try:  # a restarted actor first gets back this round's state of all its clients
                        self.recover(index, rnd, f"{phase} of {what}: {reason}")
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

    def await_actor(self, index: int, patience_s: float = 300.0) -> bool:
        """Wait until a (restarting) client actor answers again; False if it is gone for good. Raises
        :class:`UnplaceableError` when it lost its node and the cluster left has no room to place it again."""
        start = time.monotonic()
        deadline = start + patience_s
        while time.monotonic() < deadline:
            try:
                ray.get(self.actors[index].ping.remote(), timeout=min(60.0, patience_s))
                return True
            except ray.exceptions.ActorDiedError:
                return False
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                if time.monotonic() - start > UNPLACEABLE_AFTER_S:
                    why = unplaceable()
                    if why:
                        hosted = sorted(c for c, a in self.assignment.items() if a == index)
                        raise UnplaceableError(f"client actor {index} (clients {', '.join(map(str, hosted))}) lost its "
                                          f"node and cannot be placed again: {why}; the run keeps its last "
                                          f"committed round: --resume once the cluster has room") from None
                time.sleep(0.5)
        return False


UNPLACEABLE_AFTER_S = 15.0
"""How long an actor that does not answer gets to be placed again before the cluster is asked whether it
can be at all (Ray reschedules a lost node's bundles as soon as it has room)."""


class UnplaceableError(RuntimeError):
    """A client actor lost its node and the cluster left cannot place it again."""


def unplaceable() -> str | None:
    """What the run's placement group lacks where a node it had bundles on was lost and the nodes left
    cannot take them (its state ``RESCHEDULING`` and the lost bundles' resources more than the cluster has
    free); None where nothing is lost or it fits (Ray places it again)."""
    from ray.util.placement_group import get_current_placement_group, placement_group_table

    pg = get_current_placement_group()
    if pg is None:
        return None
    table = placement_group_table(pg)
    if table.get("state") != "RESCHEDULING":
        return None
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    lost = [b for b, node in table["bundles_to_node_id"].items() if node not in alive]
    need: dict[str, float] = {}
    for b in lost:
        for key, value in table["bundles"][b].items():
            if "_group_" not in key:  # (a bundle's own resource names are internal)
                need[key] = need.get(key, 0.0) + float(value)
    free = ray.available_resources()
    short = {k: round(v - free.get(k, 0.0), 3) for k, v in need.items() if v > free.get(k, 0.0) + 1e-9}
    if not short:
        return None
    return f"its bundles need {need}, the nodes left lack {short}"
