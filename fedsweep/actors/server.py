"""ServerActor: the round loop.

Each round: the chain samples ⌈C·K⌉ clients (deterministic in seed and round) and decides who answers
(``federation.participation``), ``dispatch`` (the download compressed: ``federation.download``), put
each distinct payload in the object store once, train on the ClientActors in parallel, pass the
updates through the server's chain (``federation.chain``: decode, screen, robust rule), ``aggregate``, evaluate every client every ``eval_every``
rounds (and at the last round), and checkpoint atomically. The client actors' lives are the client
fleet's (:class:`~fedsweep.actors.fleet.ClientFleet`): the server asks it to train, evaluate,
checkpoint, seal and flush, and it makes the calls, recovers restarted actors (a call that fails is
retried once, its actor brought back to where the round stands; a client that fails again is left
out of the round and named in its report) and writes and commits the rounds.

The driver polls :meth:`progress` while :meth:`run_round` runs (the actor has two
threads for that).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from fedsweep import checkpoint as ckpt
from fedsweep.actors.fleet import ClientFleet
from fedsweep.actors.heap import built_then_frozen
from fedsweep.actors.probe import NO_PROBE, Probe
from fedsweep.actors.progress import Progress
from fedsweep.actors.round_phases import phases, work
from fedsweep.algorithms import registry
from fedsweep.algorithms.tensors import tensor_bytes
from fedsweep.algorithms.types import ClientInfo, ServerContext, ServerState
from fedsweep.federation.chain import ServerChain
from fedsweep.config import ExperimentConfig
from fedsweep.lazy import import_now, torch
from fedsweep.metrics import EVAL_KEYS, EVAL_WEIGHT
from fedsweep.storage import location


@dataclass
class _Round:
    """What a round has gathered so far (:meth:`ServerActor.run_round`'s steps fill it in)."""

    rnd: int
    t0: float
    sampled: list[int] = field(default_factory=list)
    sent: Any = None
    """The chain's downloads of the round (``federation.chain.Sent``): who answers, payloads, bytes."""
    results: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    rejected: dict = field(default_factory=dict)
    report: Any = None
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    evaluated: bool = False
    reused: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    robust_dropped: list[int] = field(default_factory=list)


class ServerActor:
    @built_then_frozen
    def __init__(self, cfg: ExperimentConfig, infos: list[dict], actors: list, assignment: dict[int, int],
                 state_root: str, public: list[dict] | None = None, restore_from: str | None = None,
                 theta0: list | None = None, probe: Probe = NO_PROBE):
        """``cfg``: the validated experiment config; ``state_root``: where rounds are committed;
        ``restore_from``: the round folder to start from (the runner chose and verified it), None for a
        fresh run; ``theta0``: ``[ObjectRef]`` of θ_0 from a client actor (asked of client actor 0 if
        not given); ``probe``: handed to the client fleet (``actors.probe``: the recovery tests')."""
        import_now()  # θ_0 arrives as tensors: torch imported while the client actors build, not after
        self.cfg = cfg
        self.infos = [ClientInfo(**i) for i in infos]
        self.assignment = {int(k): v for k, v in assignment.items()}
        self.algo = registry.create(self.cfg.algorithm, self.cfg.algo_params)
        self.embed = None
        if self.algo.server_encoder_name():  # (given to init, and to every round's aggregation)
            from fedsweep.models.encoder import load_encoder

            self.embed = load_encoder(self.algo.server_encoder_name())
        self.chain = ServerChain(cfg, self.infos, self.embed, self.algo.capabilities)  # federation
        self.timeout = self.cfg.server.call_timeout_s
        last = location(restore_from) if restore_from else None
        if last is not None:
            tensors = ckpt.read_tensors(last / "server.safetensors")
            meta = ckpt.read_json(last / "server.json")
            self.state = ckpt.server_state_from(tensors, meta["algorithm"])
            self.completed = meta["round"]
        self.progress_view = Progress()
        self.fleet = ClientFleet.for_run(cfg, actors, self.assignment, location(state_root), last,
                                         self.completed if last is not None else 0, self.progress_view, probe)
        if last is None:
            ref = theta0[0] if theta0 else actors[0].initial_params.remote()
            params0 = ray.get(ref, timeout=self.timeout)
            ctx = ServerContext(self.infos, public if self.algo.capabilities.public_prompts else None,
                                self.embed, self.cfg.seed)
            self.state = self.algo.init(params0, ctx)
            self.state.meta.setdefault("seed", self.cfg.seed)
            self.completed = 0

    def completed_rounds(self) -> int:
        return self.completed

    def progress(self) -> dict[str, Any]:
        return self.progress_view.snapshot()

    def flush_checkpoint(self) -> int:
        """Commit a deferred round now (the run stops); the last committed round."""
        return self.fleet.flush()

    # ---------------------------------------------------------------------- round
    def run_round(self, rnd: int) -> dict[str, Any]:
        """One round, step by step; its report (metrics, each client's, failures, retries, artifacts)."""
        if rnd != self.completed + 1:
            raise RuntimeError(f"round {rnd} requested but {self.completed} rounds are complete")
        r = _Round(rnd, time.perf_counter())
        self.fleet.begin_round(rnd)
        self._train(r)
        self._aggregate(r)
        self._final_update(r)
        self._evaluate(r)
        self._checkpoint(r)
        self.completed = rnd
        record = self._report(r)
        if self.cfg.checkpoint.enabled:  # the record first, then the commit: a committed round has its record
            self.fleet.seal(rnd, dict(record))
        return {**record, "committed_round": self.fleet.committed_round if self.cfg.checkpoint.enabled else rnd}

    def _train(self, r: "_Round") -> None:
        """Sample; the chain decides who answers and sends the downloads; train, each answer received by
        the chain as it comes."""
        r.sent = sent = self.chain.open(r.rnd, lambda answering: self.algo.dispatch(r.rnd, answering, self.state),
                                        self.state)
        r.sampled = sent.participation.sampled
        t0 = time.perf_counter()
        r.results, r.failures = self.fleet.train(r.rnd, sent.payloads, on_answer=lambda res: self.chain.receive(res, sent),
                                                 partial_sums=sent.partial_sums)
        r.seconds["train_seconds"] = time.perf_counter() - t0
        for res in r.results.values():
            r.client_metrics[res.cid] = {**res.metrics, "bytes_up": float(res.bytes_up),
                                         "bytes_down": float(sent.bytes_down[res.cid])}

    def _aggregate(self, r: "_Round") -> None:
        """The chain screens the answers and applies the robust rule; the method aggregates what it kept."""
        closed = self.chain.close(r.rnd, r.results, r.failures, r.sent,
                                  fetch=lambda cids: self.fleet.uploads(r.rnd, cids))
        r.rejected, r.robust_dropped = closed.rejected, closed.left_out
        r.failures.update(closed.rejected)
        r.seconds.update(closed.metrics)
        self.progress_view.set(phase="aggregate")
        t0 = time.perf_counter()
        self.state, r.report = self.algo.aggregate(r.rnd, closed.kept, self.state, closed.context)
        r.seconds["aggregation_seconds"] = time.perf_counter() - t0
        for cid, extra in r.report.client_metrics.items():
            r.client_metrics.setdefault(cid, {}).update(extra)

    def _final_update(self, r: "_Round") -> None:
        """After the last round's aggregation, the method's one more local update, if it has one."""
        final = self.algo.final_payloads(self.state, [i.cid for i in self.infos]) if r.rnd == self.cfg.rounds else None
        if not final:
            return
        t0 = time.perf_counter()
        results, failed = self.fleet.final_update(r.rnd, final)
        r.seconds["final_update_seconds"] = time.perf_counter() - t0
        r.failures.update({cid: f"final update failed: {why}" for cid, why in failed.items()})
        for cid, res in results.items():
            m = r.client_metrics.setdefault(cid, {})
            m["final_train_loss"] = res.metrics["train_loss"]
            m["final_train_tokens"] = res.metrics.get("train_tokens", 0.0)
            if "dp_epsilon" in res.metrics:  # the final update spends privacy too
                m["dp_epsilon"] = res.metrics["dp_epsilon"]

    def _evaluate(self, r: "_Round") -> None:
        """Every client, every ``eval_every`` rounds and at the last."""
        r.evaluated = r.rnd % self.cfg.eval_every == 0 or r.rnd == self.cfg.rounds
        r.seconds["eval_seconds"] = 0.0
        if not r.evaluated:
            return
        t0 = time.perf_counter()
        payloads = {info.cid: self.algo.eval_payload(self.state, info.cid) for info in self.infos}
        evals, failed = self.fleet.evaluate(r.rnd, payloads)
        r.seconds["eval_seconds"] = time.perf_counter() - t0
        for cid, m in evals.items():
            r.client_metrics.setdefault(cid, {}).update(m)
        r.failures.update({cid: f"evaluation failed: {why}" for cid, why in failed.items()})

    def _checkpoint(self, r: "_Round") -> None:
        self.progress_view.set(phase="checkpoint")
        t0 = time.perf_counter()
        r.reused = self.fleet.checkpoint(r.rnd, self.state) if self.cfg.checkpoint.enabled else 0
        r.seconds["checkpoint_seconds"] = time.perf_counter() - t0

    def _report(self, r: "_Round") -> dict[str, Any]:
        """The round's record: its metrics (``logged_at``: the timestamp every one of them is logged
        with, so that logging it twice logs it once), each client's, failures, retries, artifacts."""
        moved = self.fleet.end_round()  # (the retried clients and bytes moved; the fleet's round forgotten)
        metrics = dict(r.report.metrics)
        metrics.update(self._global_metrics(r.results, r.client_metrics, r.evaluated))
        round_s = time.perf_counter() - r.t0 - r.seconds.get("final_update_seconds", 0.0)  # (its own phase)
        metrics.update(phases(r.seconds, r.results, self.assignment, round_s))
        metrics.update(work(r.client_metrics))
        metrics.update({"round_seconds": round_s, **r.seconds,
                        "clients_sampled": float(len(r.sampled)), "clients_failed": float(len(r.failures)),
                        "clients_dropped": float(len(r.sent.participation.dropped)),
                        "clients_late": float(len(r.sent.participation.late)),
                        "clients_answering": float(len(r.sent.participation.answering)),
                        **({"robust_clients_dropped": float(len(r.robust_dropped))} if r.robust_dropped else {}),
                        "clients_rejected": float(len(r.rejected)), "clients_retried": float(len(moved["retried"])),
                        "checkpoint_clients_reused": float(r.reused),
                        "checkpoint_deferred": float(self.cfg.checkpoint.enabled and self.fleet.defers(r.rnd))})
        client_compute = [res.metrics.get("train_seconds", 0.0) for res in r.results.values()]
        if client_compute:
            metrics["slowest_client_seconds"] = max(client_compute)
            busy: dict[int, float] = {}  # an actor's groups train one after another
            for cid, res in r.results.items():
                busy[self.assignment[cid]] = busy.get(self.assignment[cid], 0.0) + res.metrics.get("train_seconds", 0.0)
            metrics["busiest_actor_train_seconds"] = max(busy.values())
            # what training took beyond the busiest actor's own computing: the payloads' and uploads'
            # way between the server and its actors (and the server's receiving of them)
            metrics["traffic_seconds"] = max(0.0, r.seconds["train_seconds"] - metrics["busiest_actor_train_seconds"])
        metrics["traffic_bytes"] = float(moved["traffic_bytes"])
        sizes = [tensor_bytes(p.params) for p in r.sent.payloads.values()] + \
            [tensor_bytes(res.upload.params) for res in r.results.values()]
        metrics["adapter_bytes"] = float(max(sizes, default=0))  # one client's trainable state as it travels
        self.progress_view.set(phase="idle")
        retried = moved["retried"]
        artifacts = dict(r.report.artifacts)
        cc, sc = self.cfg.clients, self.cfg.server
        if cc.dropout or sc.deadline_s is not None or cc.over_selection or sc.robust.rule != "none":
            artifacts["participation.json"] = json.dumps({**r.sent.participation.as_dict(),
                                                          "robust_dropped": r.robust_dropped}, indent=1)
        return {"round": r.rnd, "sampled": r.sampled, "participation": r.sent.participation.as_dict(), "metrics": metrics,
                "client_metrics": r.client_metrics, "failures": r.failures, "retried": retried,
                "artifacts": artifacts, "evaluated": r.evaluated, "logged_at": int(time.time() * 1000)}

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

    # ------------------------------------------------------------------ inspection
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return ckpt.server_state_tensors(self.state)

    def server_state(self) -> ServerState:
        return self.state
