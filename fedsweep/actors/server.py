"""ServerActor: the round loop.

Each round: sample ⌈C·K⌉ clients (deterministic in seed and round), ``dispatch``, put
each distinct payload in the object store once, train on the ClientActors in parallel,
screen the updates (``screening``), ``aggregate``, evaluate every client every ``eval_every``
rounds (and at the last round), and checkpoint atomically (``round_checkpoint``). A client call
that fails is retried once (its actor restarts and restores the last checkpoint: ``client_calls``);
a client that fails again is left out of the round and named in the round's report.

The driver polls :meth:`progress` while :meth:`run_round` runs (the actor has two
threads for that).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from fedsweep import checkpoint as ckpt
from fedsweep.actors.client_calls import ClientCalls
from fedsweep.actors.heap import built_then_frozen
from fedsweep.actors.round_checkpoint import DeferredRound, RoundCheckpoints
from fedsweep.actors.screening import UpdateNorms, screen
from fedsweep.algorithms import registry
from fedsweep.algorithms.types import ClientInfo, ServerState, payload_bytes
from fedsweep.config import ExperimentConfig
from fedsweep.lazy import import_now, torch
from fedsweep.metrics import EVAL_KEYS, EVAL_WEIGHT
from fedsweep.storage import location


def sample_clients(seed: int, rnd: int, num_clients: int, fraction: float) -> list[int]:
    """⌈C·K⌉ distinct clients, a pure function of (seed, round)."""
    m = min(num_clients, max(1, math.ceil(fraction * num_clients)))
    rng = np.random.default_rng([seed, 3, rnd])
    return sorted(rng.choice(num_clients, size=m, replace=False).tolist())


class NoUsableUpdate(RuntimeError):
    """Every client update of a round was rejected or failed."""


class ServerActor(ClientCalls, RoundCheckpoints):
    @built_then_frozen
    def __init__(self, cfg: ExperimentConfig, infos: list[dict], actors: list, assignment: dict[int, int],
                 state_root: str, public: list[dict] | None = None, restore_from: str | None = None,
                 theta0: list | None = None, faults=None):
        """``cfg``: the validated experiment config; ``state_root``: where rounds are committed;
        ``restore_from``: the round folder to start from (the runner chose and verified it), None for a
        fresh run; ``theta0``: ``[ObjectRef]`` of θ_0 from a client actor (asked of client actor 0 if
        not given); ``faults``: the recovery tests' armed fault points (``actors.faults``), None in a run."""
        import_now()  # θ_0 arrives as tensors: torch imported while the client actors build, not after
        self.cfg = cfg
        self.faults = faults
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
        self._round_calls: list[tuple[int, list[int], list]] = []  # this round's answered training calls
        self._retried: dict[int, str] = {}
        self._known = {i: inc["token"] for i, inc in self._incarnations().items() if inc is not None}
        self._former: set[str] = set()  # incarnation tokens of lives adopted away
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

    # ---------------------------------------------------------------------- round
    def run_round(self, rnd: int) -> dict[str, Any]:
        if rnd != self.completed + 1:
            raise RuntimeError(f"round {rnd} requested but {self.completed} rounds are complete")
        t_round = time.perf_counter()
        self._round_calls, self._retried = [], {}
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
        self._round_calls = []
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

    # ------------------------------------------------------------------ inspection
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return ckpt.server_state_tensors(self.state)

    def server_state(self) -> ServerState:
        return self.state
