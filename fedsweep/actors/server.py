"""ServerActor: the round loop.

Each round: sample ⌈C·K⌉ clients (deterministic in seed and round), ``dispatch``, put
each distinct payload in the object store once, train on the ClientActors in parallel,
reject non-finite uploads, ``aggregate``, evaluate every client every ``eval_every``
rounds (and at the last round), and checkpoint atomically. A client call that fails is
retried once (its actor restarts and restores the last checkpoint); a client that fails
again is left out of the round and named in the round's report.

The driver polls :meth:`progress` while :meth:`run_round` runs (the actor has two
threads for that).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from fedsweep import checkpoint as ckpt
from fedsweep.actors.client_state import write_files
from fedsweep.actors.faults import fault_point
from fedsweep.actors.heap import built_then_frozen
from fedsweep.algorithms import registry
from fedsweep.algorithms.tensors import Params, as_vector
from fedsweep.algorithms.types import ClientInfo, Payload, ServerState, payload_bytes
from fedsweep.config import ExperimentConfig
from fedsweep.errors import one_line
from fedsweep.lazy import import_now, torch
from fedsweep.metrics import EVAL_KEYS, EVAL_WEIGHT
from fedsweep.storage import location


def sample_clients(seed: int, rnd: int, num_clients: int, fraction: float) -> list[int]:
    """⌈C·K⌉ distinct clients, a pure function of (seed, round)."""
    m = min(num_clients, max(1, math.ceil(fraction * num_clients)))
    rng = np.random.default_rng([seed, 3, rnd])
    return sorted(rng.choice(num_clients, size=m, replace=False).tolist())


def start_vector(start: Params, params: Params) -> torch.Tensor:
    """θ_start laid out as ``as_vector`` lays out ``params``, in float64: zeros where the start has no
    tensor of that name and shape (there the update is the parameter itself)."""
    laid = {k: start[k] if k in start and start[k].shape == v.shape else torch.zeros_like(v) for k, v in params.items()}
    return as_vector(laid, torch.float64).to(next(iter(params.values())).device)


def nonfinite(upload_params) -> str | None:
    """The first tensor holding a NaN or an infinity, named; None if every value is finite."""
    return next((f"non-finite values in {k}" for k, v in (upload_params or {}).items()
                 if not bool(torch.isfinite(v).all())), None)


class NoUsableUpdate(RuntimeError):
    """Every client update of a round was rejected or failed."""


class UpdateNorms:
    """Per client with uploaded parameters: ‖θ_k − θ_start‖ in float64 (‖θ_k‖ for a tensor its start
    lacks or shapes differently, and without a start), and ‖θ_start‖ (clients with a start). A start
    shared by many clients (a global model) is laid out and measured once. A norm is finite exactly
    when every uploaded value is (float32 squares cannot overflow float64).

    The server adds each training call's results (:meth:`add`) as the call answers, while the
    actors still train: after the round's last answer only that answer's clients are left to
    measure (at K = 50 on the 135M model all 50 took 60–100 ms of a 2-core VM's round)."""

    def __init__(self, starts: dict) -> None:
        self.starts = starts
        self._measured: dict[int, tuple[Any, float | None, float | None]] = {}  # cid -> (result, norm, size)
        self._laid_out: dict[tuple, torch.Tensor] = {}
        self._start_norm: dict[int, float] = {}

    def add(self, results: dict) -> None:
        for cid, r in results.items():
            if cid not in self._measured or self._measured[cid][0] is not r:  # new, or trained again
                self._measured[cid] = (r, *self._measure(cid, r.upload.params))

    def _measure(self, cid: int, params: Params | None) -> tuple[float | None, float | None]:
        if not params:
            return None, None
        vec, start = as_vector(params, torch.float64), self.starts.get(cid)  # (one vector per set: a 135M
        # upload is 120 tensors, and screening 50 of them a tensor at a time took 0.32 s of a round)
        if not start:
            return float(torch.linalg.vector_norm(vec)), None
        key = (id(start), tuple((k, tuple(v.shape)) for k, v in params.items()))
        if key not in self._laid_out:
            self._laid_out[key] = start_vector(start, params)
        if id(start) not in self._start_norm:
            self._start_norm[id(start)] = float(torch.linalg.vector_norm(as_vector(start, torch.float64)))
        return float(torch.linalg.vector_norm(vec - self._laid_out[key])), self._start_norm[id(start)]

    def of(self, results: dict) -> tuple[dict[int, float], dict[int, float]]:
        """(update norms, start norms) of ``results``' clients, measuring what was not added yet."""
        self.add(results)
        measured = [(cid, *self._measured[cid][1:]) for cid in results]
        return ({cid: n for cid, n, _ in measured if n is not None},
                {cid: size for cid, _, size in measured if size is not None})


def update_norms(results: dict, starts: dict) -> tuple[dict[int, float], dict[int, float]]:
    """:class:`UpdateNorms` of ``results`` at once."""
    return UpdateNorms(starts).of(results)


def screen(results: dict, starts: dict, max_update_ratio: float, max_loss_ratio: float,
           measured: UpdateNorms | None = None) -> dict[int, str]:
    """Reasons to reject client results: non-finite uploads or losses, an exploding training loss
    (last > ``max_loss_ratio`` × first), an update norm (:func:`update_norms`) above
    ``max_update_ratio`` × the norm of the parameters it started from (caught even when every client
    diverges alike), or above ``max_update_ratio`` × the median of the other clients' update norms
    (leave-one-out, so one diverged client of two is still caught). ``measured``: norms measured as
    the results came (from the same ``starts``)."""
    why: dict[int, str] = {}
    all_norms, sizes = (measured or UpdateNorms(starts)).of(results)
    norms: dict[int, float] = {}
    for cid, r in results.items():
        norm = all_norms.get(cid)
        bad = nonfinite(r.upload.params) if norm is not None and not math.isfinite(norm) else None
        loss, first, last = (r.metrics.get(k) for k in ("train_loss", "train_loss_first", "train_loss_last"))
        if bad:
            why[cid] = f"update rejected: {bad}"
        elif loss is not None and not np.isfinite(loss):
            why[cid] = f"update rejected: non-finite training loss {loss}"
        elif first is not None and last is not None and np.isfinite(first) and first > 0 and last > max_loss_ratio * first:
            why[cid] = f"update rejected: training loss exploded ({first:.4g} → {last:.4g})"
        elif norm is not None:
            norms[cid] = norm
    for cid in list(norms):  # an update far larger than the parameters it started from: every client may diverge
        size = sizes.get(cid)
        if size and norms[cid] > max_update_ratio * size:
            why[cid] = (f"update rejected: norm {norms[cid]:.4g} is over {max_update_ratio:g}× that of the "
                        f"parameters it started from ({size:.4g})")
            del norms[cid]
    for cid, n in norms.items():
        others = [m for c, m in norms.items() if c != cid]
        if not others:
            continue
        med = float(np.median(others))
        if med > 0 and n > max_update_ratio * med:
            why[cid] = f"update rejected: norm {n:.4g} is over {max_update_ratio:g}× the others' median {med:.4g}"
    return why


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


@dataclass
class DeferredRound:
    """A round whose checkpoint is being written while the next one trains (``checkpoint.overlap``)."""

    rnd: int
    stage: Any
    previous: str | None
    calls: dict[int, list]
    """Its training calls per client: replayed by an actor that must write its files again."""
    acks: list[dict[str, Any]]
    """Each client actor's answer to ``save``."""
    refs: list
    """Per client actor, ``ClientActor.saved`` (None: it saved synchronously)."""
    committed: Future | None = None
    """:meth:`ServerActor._commit_when_written`, on the server's writer thread."""
    asked: threading.Event = field(default_factory=threading.Event)
    """Set once the round thread waits for the commit (:meth:`ServerActor._finish_deferred`)."""


class FilesLost(Exception):
    """Client actors (``indexes``) died before their files of a deferred round were on disk; ``known``:
    the digests of every other file of the round."""

    def __init__(self, indexes: list[int], known: dict[str, dict]):
        super().__init__(f"client actors {indexes} died before their checkpoint files were written")
        self.indexes, self.known = indexes, known


def _died(exc: BaseException) -> bool:
    """Whether a failed call means its actor's process is gone (or answers as a new incarnation)."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return True
    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, LookupError)


class ServerActor:
    @built_then_frozen
    def __init__(self, cfg: ExperimentConfig, infos: list[dict], actors: list, assignment: dict[int, int],
                 state_root: str, public: list[dict] | None = None, restore_from: str | None = None,
                 theta0: list | None = None):
        """``cfg``: the validated experiment config; ``state_root``: where rounds are committed;
        ``restore_from``: the round folder to start from (the runner chose and verified it), None for a
        fresh run; ``theta0``: ``[ObjectRef]`` of θ_0 from a client actor (asked of client actor 0 if
        not given)."""
        import_now()  # θ_0 arrives as tensors: torch imported while the client actors build, not after
        self.cfg = cfg
        self.infos = [ClientInfo(**i) for i in infos]
        self.actors = actors
        self.assignment = {int(k): v for k, v in assignment.items()}
        self.root = location(state_root)
        self.algo = registry.create(self.cfg.algorithm, self.cfg.algo_params)
        encoder = self.algo.server_encoder_name()
        if encoder:
            from fedsweep.models.encoder import load_encoder

            self.algo.embed = load_encoder(encoder)
        self.timeout = self.cfg.server.call_timeout_s
        self._round_calls: dict[int, list] = {}  # cid -> payload refs of this round's train calls, in order
        self._retried: dict[int, str] = {}
        self._known = {i: inc["token"] for i, inc in self._incarnations().items() if inc is not None}
        self._lock = threading.Lock()
        self._progress: dict[str, Any] = {"round": 0, "phase": "idle", "done": 0, "total": 0, "loss": None}
        last = location(restore_from) if restore_from else None
        self._last_committed = last  # the source clients reuse unchanged files from
        self._deferred: DeferredRound | None = None
        self._deferred_lock = threading.RLock()
        self._write_pool: ThreadPoolExecutor | None = None
        if last is not None:
            tensors = ckpt.read_tensors(last / "server.safetensors")
            meta = ckpt.read_json(last / "server.json")
            self.state = ckpt.server_state_from(tensors, meta["algorithm"])
            self.completed = meta["round"]
        else:
            ref = theta0[0] if theta0 else self.actors[0].initial_params.remote()
            params0 = ray.get(ref, timeout=self.timeout)
            extra = {"public": public} if self.algo.capabilities.public_prompts else {}
            self.state = self.algo.init(params0, self.infos, **extra)
            self.state.meta.setdefault("seed", self.cfg.seed)
            self.completed = 0
        self._committed_round = self.completed

    def completed_rounds(self) -> int:
        return self.completed

    def progress(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._progress)

    def _set(self, **kw) -> None:
        with self._lock:
            self._progress.update(kw)

    # ------------------------------------------------------------ actor recovery
    # Exactly-once rounds: a client actor that dies is restarted by Ray and comes back with the state
    # it was constructed with, which undoes this round's training of clients whose results the server
    # already holds. Whenever the server sees a new incarnation of an actor (a failed call, or a probe
    # at the start of a round, before evaluation and before the checkpoint) it adopts it: the actor
    # loads the round the server last committed, then this round's training calls of every client it
    # hosts are replayed in order with the same payloads — client randomness is a function of (seed,
    # round, client), so the replay rebuilds bitwise what was lost — and only then is what failed
    # retried. Results already received are kept.
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
        """Bring a new incarnation of actor ``index`` to where this round stands (no-op otherwise)."""
        if inc is None or inc["token"] == self._known.get(index):
            return
        self._known[index] = inc["token"]
        self._finish_deferred()  # the round before this one may still be on its way to disk
        self._restore_committed(index, inc)
        for cid in sorted(c for c, a in self.assignment.items() if a == index):
            self._replay(index, rnd, cid, self._round_calls.get(cid, []), reason)

    def _restore_committed(self, index: int, inc: dict[str, Any]) -> None:
        """Load the last committed round into incarnation ``inc`` of actor ``index`` unless it started from it."""
        if self._last_committed is not None and inc["restored_round"] != self._committed_round:
            ray.get(self.actors[index].restore.remote(str(self._last_committed)), timeout=self.timeout)

    def _replay(self, index: int, rnd: int, cid: int, calls: list, reason: str) -> None:
        """Train client ``cid`` again on actor ``index`` with these payloads, in order (deterministic:
        the same state comes back), so that the actor holds what the server already received."""
        for ref in calls:
            ray.get(self.actors[index].train.remote(rnd, cid, ref), timeout=self.timeout)
        if calls:
            self._retried[cid] = f"replayed after a restart of its actor ({reason})"

    def _recover(self, index: int, rnd: int, reason: str) -> None:
        """Actor ``index`` answers again after a failure: adopt it if it is a new incarnation."""
        self._adopt(index, ray.get(self.actors[index].incarnation.remote(), timeout=min(self.timeout, 600.0)),
                    rnd, reason)

    def _sync(self, rnd: int, phase: str) -> None:
        """Probe every actor; adopt any that restarted since it was last seen."""
        for i, inc in self._incarnations().items():
            try:
                self._adopt(i, inc, rnd, f"restarted before {phase}")
            except Exception:  # gone for good: its clients fail in the next call and are left out
                pass

    # ---------------------------------------------------------------------- calls
    def _train_all(self, rnd: int, payloads: dict[int, Payload], phase: str,
                   measure: UpdateNorms | None = None) -> tuple[dict, dict]:
        """Train every client of ``payloads`` in a few calls per actor (:func:`training_calls`); a call
        that fails is retried once, and so is a client whose training raised. ``measure`` takes each
        call's results as it answers. Returns (results, failures)."""
        refs: dict[int, ray.ObjectRef] = {}
        by_id: dict[int, ray.ObjectRef] = {}
        for cid, p in payloads.items():  # one put per distinct payload object
            if id(p) not in by_id:  # (not setdefault: its default, a put, would be made for every client)
                by_id[id(p)] = ray.put(p)
            refs[cid] = by_id[id(p)]

        def launch(index, cids):
            distinct = list(dict.fromkeys(refs[cid] for cid in cids))  # Ray resolves top-level refs only
            items = [(cid, distinct.index(refs[cid])) for cid in cids]
            return self.actors[index].train_many.remote(rnd, items, *distinct)

        def received(index, answer) -> tuple[dict, dict]:
            token, answers = answer
            results, errors = {}, {}
            for cid, result in answers:
                if isinstance(result, str):
                    errors[cid] = result
                    continue
                self._round_calls.setdefault(cid, []).append(refs[cid])
                results[cid] = result
                if self._known.get(index, token) != token:  # trained by an incarnation adopted away since
                    self._replay(index, rnd, cid, [refs[cid]], "its result came from the actor's previous life")
                loss = result.metrics.get("train_loss")
                if loss is not None:
                    with self._lock:
                        self._progress["loss"] = loss
            if measure is not None:  # while the other calls train
                measure.add(results)
            return results, errors

        return self._gather(training_calls(list(payloads), self.assignment), launch, received, rnd, phase)

    def _evaluate_all(self, rnd: int, payloads: dict[int, Payload]) -> tuple[dict, dict]:
        """Evaluate every client with one call per client actor (``ClientActor.evaluate_many``), its
        clients grouped by the payload they share (:func:`evaluation_groups`). Returns (metrics by
        client, failures)."""
        groups = evaluation_groups(payloads, self.assignment)

        def launch(index, cids):  # always the actor's whole group: a retry follows a failed call
            return self.actors[index].evaluate_many.remote(rnd, groups[index])

        calls = [(i, [cid for cids, _ in g for cid in cids]) for i, g in groups.items()]
        return self._gather(calls, launch, lambda index, result: (result, {}), rnd, "evaluate")

    def _gather(self, calls: list[tuple[int, list[int]]], launch, received, rnd: int, phase: str) -> tuple[dict, dict]:
        """Make every call (``(actor index, its clients)``; ``launch(index, clients)`` makes it) and
        collect the answers as they come (``received(index, answer)`` -> (results by client, errors by
        client)). A call that fails is retried once after its actor answers again (a restarted actor
        first gets back this round's state); a client whose answer is an error is retried once alone;
        what fails again fails each of its clients with the reason."""
        self._set(phase=phase, done=0, total=sum(len(cids) for _, cids in calls), round=rnd)
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
                if attempt == 0 and self._await_actor(index):
                    try:  # a restarted actor first gets back this round's state of all its clients
                        self._recover(index, rnd, f"{phase} of {what}: {reason}")
                    except Exception as again:
                        failures.update(dict.fromkeys(cids, f"{reason}; recovery failed: {type(again).__name__}"))
                        continue
                    self._retried.update(dict.fromkeys(cids, f"{phase} retried: {reason}"))
                    pending[launch(index, cids)] = (index, cids, 1)
                    continue
                failures.update(dict.fromkeys(cids, reason))
                continue
            got, errors = received(index, answer)
            results.update(got)
            for cid, reason in errors.items():
                if attempt == 0:
                    self._retried[cid] = f"{phase} retried: {reason}"
                    pending[launch(index, [cid])] = (index, [cid], 1)
                else:
                    failures[cid] = reason
            with self._lock:
                self._progress["done"] += len(got)
        return results, failures

    def _await_actor(self, index: int, patience_s: float = 300.0) -> bool:
        """Wait until a (restarting) client actor answers again; False if it is gone for good."""
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline:
            try:
                ray.get(self.actors[index].ping.remote(), timeout=min(60.0, patience_s))
                return True
            except ray.exceptions.ActorDiedError:
                return False
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)
        return False

    # ---------------------------------------------------------------------- round
    def run_round(self, rnd: int) -> dict[str, Any]:
        if rnd != self.completed + 1:
            raise RuntimeError(f"round {rnd} requested but {self.completed} rounds are complete")
        t_round = time.perf_counter()
        self._round_calls, self._retried = {}, {}
        self._sync(rnd, "the round")
        sampled = sample_clients(self.cfg.seed, rnd, self.cfg.clients.num_clients, self.cfg.clients.fraction)
        payloads = self.algo.dispatch(rnd, sampled, self.state)
        t0 = time.perf_counter()
        starts = {cid: p.params for cid, p in payloads.items()}
        measured = UpdateNorms(starts)
        results, failures = self._train_all(rnd, payloads, "train", measured)
        train_s = time.perf_counter() - t0
        sc = self.cfg.server
        rejected = screen(results, starts, sc.max_update_ratio, sc.max_loss_ratio, measured)
        failures.update(rejected)
        accepted = [results[cid] for cid in sorted(results) if cid not in rejected]
        if not accepted:
            first = sorted(failures.items())[0] if failures else None
            raise NoUsableUpdate(f"round {rnd}: no client update was usable ({len(failures)} rejected or failed; "
                                 f"client {first[0]}: {first[1]})" if first else f"round {rnd}: no client trained")
        self._set(phase="aggregate")
        t0 = time.perf_counter()
        self.state, report = self.algo.aggregate(rnd, accepted, self.state)
        agg_s = time.perf_counter() - t0

        final_s = 0.0
        final = self.algo.final_payloads(self.state, [info.cid for info in self.infos]) if rnd == self.cfg.rounds else None
        if final:
            t0 = time.perf_counter()
            final_res, final_fail = self._train_all(rnd, final, "final update")
            final_s = time.perf_counter() - t0
            failures.update({cid: f"final update failed: {why}" for cid, why in final_fail.items()})

        client_metrics: dict[int, dict[str, float]] = {}
        for r in results.values():
            client_metrics[r.cid] = {**r.metrics, "bytes_up": float(r.bytes_up),
                                     "bytes_down": float(payload_bytes(payloads[r.cid]))}
        for cid, extra in report.client_metrics.items():
            client_metrics.setdefault(cid, {}).update(extra)
        if final:
            for cid, r in final_res.items():
                m = client_metrics.setdefault(cid, {})
                m["final_train_loss"] = r.metrics["train_loss"]
                if "dp_epsilon" in r.metrics:  # the final update spends privacy too
                    m["dp_epsilon"] = r.metrics["dp_epsilon"]

        evaluated = rnd % self.cfg.eval_every == 0 or rnd == self.cfg.rounds
        eval_s = 0.0
        if evaluated:
            self._sync(rnd, "evaluation")
            t0 = time.perf_counter()
            eval_payloads = {info.cid: self.algo.eval_payload(self.state, info.cid) for info in self.infos}
            evals, eval_fail = self._evaluate_all(rnd, eval_payloads)
            eval_s = time.perf_counter() - t0
            for cid, m in evals.items():
                client_metrics.setdefault(cid, {}).update(m)
            failures.update({cid: f"evaluation failed: {why}" for cid, why in eval_fail.items()})

        self._set(phase="checkpoint")
        t0 = time.perf_counter()
        self._finish_deferred()  # the previous round's files, written while this round trained
        self._sync(rnd, "the checkpoint")
        reused = self._checkpoint(rnd) if self.cfg.checkpoint.enabled else 0
        ckpt_s = time.perf_counter() - t0
        self.completed = rnd
        metrics = dict(report.metrics)
        metrics.update(self._global_metrics(results, client_metrics, evaluated))
        metrics.update({"round_seconds": time.perf_counter() - t_round, "train_seconds": train_s,
                        "aggregation_seconds": agg_s, "eval_seconds": eval_s, "checkpoint_seconds": ckpt_s,
                        **({"final_update_seconds": final_s} if final else {}),
                        "clients_sampled": float(len(sampled)), "clients_failed": float(len(failures)),
                        "clients_rejected": float(len(rejected)), "clients_retried": float(len(self._retried)),
                        "checkpoint_clients_reused": float(reused),
                        "checkpoint_deferred": float(self.cfg.checkpoint.enabled and self._defers(rnd))})
        client_compute = [r.metrics.get("train_seconds", 0.0) for r in results.values()]
        if client_compute:
            metrics["slowest_client_seconds"] = max(client_compute)
            busy: dict[int, float] = {}  # an actor trains its clients one after another
            for cid, r in results.items():
                busy[self.assignment[cid]] = busy.get(self.assignment[cid], 0.0) + r.metrics.get("train_seconds", 0.0)
            metrics["busiest_actor_train_seconds"] = max(busy.values())
        self._set(phase="idle")
        retried = dict(self._retried)
        self._round_calls = {}
        return {"round": rnd, "sampled": sampled, "metrics": metrics, "client_metrics": client_metrics,
                "failures": failures, "retried": retried, "artifacts": report.artifacts, "evaluated": evaluated}

    def _global_metrics(self, results, client_metrics, evaluated) -> dict[str, float]:
        out: dict[str, float] = {}
        if results:
            n = np.array([r.num_examples for r in results.values()], dtype=float)
            out["train_loss"] = float(np.dot(n, [r.metrics["train_loss"] for r in results.values()]) / n.sum())
            out["bytes_up"] = float(sum(r.bytes_up for r in results.values()))
            out["bytes_down"] = float(sum(m.get("bytes_down", 0.0) for m in client_metrics.values()))
        if evaluated:
            rows = [m for m in client_metrics.values() if "test_loss" in m]
            if rows:
                for key in [k for k in EVAL_KEYS if all(k in m for m in rows)]:
                    w = np.array([m.get(EVAL_WEIGHT[key], 1.0) for m in rows])
                    vals = np.array([m[key] for m in rows])
                    out[key] = float(np.dot(w, vals) / w.sum())
                    out[f"{key}_client_mean"] = float(vals.mean())
                    out[f"{key}_client_std"] = float(vals.std())
        return out

    def _checkpoint(self, rnd: int) -> int:
        """Write round ``rnd`` atomically (committed now, or, deferred, once its files are written:
        :meth:`_finish_deferred`); returns how many clients' files were reused unchanged."""
        previous = self._last_committed
        stage = ckpt.staging_dir(self.root, rnd)
        prev = str(previous) if previous is not None else None
        defer = self._defers(rnd)
        refs = [a.save.remote(str(stage), prev, defer) for a in self.actors]
        saved = []
        for i, ref in enumerate(refs):
            try:
                saved.append(ray.get(ref, timeout=self.timeout))
            except Exception as exc:  # died while saving: recover its clients' state, save again
                if not self._await_actor(i):
                    raise
                self._recover(i, rnd, f"checkpoint: {type(exc).__name__}")
                saved.append(ray.get(self.actors[i].save.remote(str(stage), prev), timeout=self.timeout))
        server_files = [(stage / "server.safetensors", ckpt.tensor_chunks(ckpt.server_state_tensors(self.state))),
                        (stage / "server.json", [ckpt.json_bytes({"round": rnd, "algorithm": self.state.meta})])]
        if not defer:
            known = {name: entry for s in saved for name, entry in s["files"].items()}
            self._commit(rnd, {**known, **write_files(server_files)})
        else:
            refs = [self.actors[i].saved.remote(str(stage)) if s.get("deferred") else None for i, s in enumerate(saved)]
            d = DeferredRound(rnd, stage, prev, dict(self._round_calls), saved, refs)
            d.committed = self._writer().submit(self._commit_when_written, d, server_files)
            with self._deferred_lock:
                self._deferred = d
        return sum(len(s["reused"]) for s in saved)

    def _defers(self, rnd: int) -> bool:
        """Whether round ``rnd``'s files are written while the next round trains (``checkpoint.overlap``;
        never the last round, nor sharded clients)."""
        return self.cfg.checkpoint.overlap and rnd < self.cfg.rounds and self.cfg.clients.shards == 1

    def _commit(self, rnd: int, known: dict[str, dict]) -> None:
        self._last_committed = ckpt.commit(self.root, rnd, self.cfg.checkpoint.keep, known)
        self._committed_round = rnd

    def _writer(self) -> ThreadPoolExecutor:
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        return self._write_pool

    def _commit_when_written(self, d: DeferredRound, server_files: list) -> None:
        """On the server's writer thread: write the server's files of round ``d.rnd``, wait for every
        client actor's, and commit the round as soon as they are all on disk. Raises
        :class:`FilesLost` when actors died before theirs were (the round thread writes them again)."""
        known = write_files(server_files)
        lost = []
        for i, (ack, ref) in enumerate(zip(d.acks, d.refs)):
            if ref is None:  # this actor wrote synchronously (a retried save)
                known.update(ack["files"])
                continue
            try:
                known.update(ray.get(ref, timeout=self.timeout)["files"])
            except Exception as exc:
                if not _died(exc):
                    raise RuntimeError(f"round {d.rnd}'s checkpoint could not be written: {one_line(exc)}") from None
                lost.append(i)
        if lost:
            raise FilesLost(lost, known)
        if fault_point("hold_commit", d.rnd, 0):  # recovery tests: only the round thread's wait commits
            d.asked.wait(self.timeout)
        self._commit(d.rnd, known)

    def _finish_deferred(self) -> None:
        """Make sure the round whose files were written while this one trained is committed (no-op if
        none). A client actor that died before its files were on disk writes
        them again (:meth:`_write_again`), and then the round is committed."""
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
                    if not self._await_actor(i):
                        raise RuntimeError(f"round {d.rnd}'s checkpoint: client actor {i} died before its "
                                           "files were written and does not come back") from None
                    known.update(self._write_again(i, d)["files"])
                self._commit(d.rnd, known)

    def flush_checkpoint(self) -> int:
        """Commit a deferred round now (the run stops); the last committed round."""
        self._finish_deferred()
        return self._committed_round

    def _write_again(self, index: int, d: DeferredRound) -> dict[str, Any]:
        """Actor ``index`` was restarted before round ``d.rnd``'s files of its clients were written:
        bring them back to the end of that round (the committed round before it, then that round's
        training calls replayed, as :meth:`_adopt` does) and save them synchronously. The incarnation
        is left to be adopted for the round in progress (``_sync``/``_recover`` replay that round)."""
        inc = ray.get(self.actors[index].incarnation.remote(), timeout=min(self.timeout, 600.0))
        if inc["token"] == d.acks[index].get("token"):
            raise RuntimeError(f"round {d.rnd}'s checkpoint: client actor {index} lost its files but did not restart")
        self._restore_committed(index, inc)
        for cid in sorted(c for c, a in self.assignment.items() if a == index):
            self._replay(index, d.rnd, cid, d.calls.get(cid, []), f"its round-{d.rnd} checkpoint files were lost")
        return ray.get(self.actors[index].save.remote(str(d.stage), d.previous), timeout=self.timeout)

    # ------------------------------------------------------------------ inspection
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return ckpt.server_state_tensors(self.state)

    def server_state(self) -> ServerState:
        return self.state
