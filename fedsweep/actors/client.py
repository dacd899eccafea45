"""ClientActor: one frozen base model, the state of one or more clients, their rounds.

The base model and its adapter modules are loaded once (:class:`~fedsweep.engine.base.FrozenBase`).
Each hosted client keeps its own adapter tensors, optimiser state and algorithm state
(:class:`~fedsweep.actors.client_state.ClientSlot`); a call binds the adapters of the clients it
computes (``clients_per_actor > 1`` packs many clients on one base). Training runs the engine's
one step loop over groups of up to ``train.batch_clients`` clients (``engine.training``), and
evaluation its one evaluation path (``engine.evaluation``). Randomness of a client's round (batch
order, dropout) is derived from (seed, round, client), so results do not depend on which actor
hosts a client, which clients share its steps, or whether the run was resumed.

This class is the Ray-facing part: it runs the method's client hooks around the engine, and hands
the rest to its collaborators: the method's contexts (``method_hooks``), the base's versions
(``base_versions``), evaluation (``client_eval``), checkpoints (``client_saves``) and the upload's
way out (``federation.chain``). It is a plain class: ``actors.remote`` wraps it for Ray; tests may
use it in-process.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from typing import Any

import ray

from fedsweep.actors.base_versions import BaseVersions
from fedsweep.actors.client_eval import ClientEvaluation
from fedsweep.actors.client_saves import ClientSaves
from fedsweep.actors.client_state import ClientSlot, restore_slots
from fedsweep.actors.heap import built_then_frozen
from fedsweep.actors.inputs import loaded
from fedsweep.actors.method_hooks import MethodHooks
from fedsweep.actors.probe import NO_PROBE, Probe, round_of
from fedsweep.algorithms import registry
from fedsweep.algorithms.tensors import Params, clone
from fedsweep.algorithms.types import ClientResult, Payload
from fedsweep.data.bundled import warm_scorers
from fedsweep.actors.engine_setup import build_base, settings_from
from fedsweep.actors.partial_sums import round_uploads, summed_uploads
from fedsweep.config import ExperimentConfig
from fedsweep.engine.base import device_of
from fedsweep.engine.rows import training_groups
from fedsweep.engine.training import batch_order
from fedsweep.errors import one_line
from fedsweep.actors.client_training import ClientTraining
from fedsweep.federation.chain import ClientChain
from fedsweep.lazy import torch

MODULE_READY = time.time()  # fedsweep and transformers' config side imported (torch: at its first use, in __init__)


class ClientActor:
    @built_then_frozen  # (in its own process: construction without cyclic collections, then frozen)
    def __init__(self, cfg: ExperimentConfig, clients: list[dict[str, Any]], restore_from: str | None = None,
                 pool: list[dict] | None = None, group=None, probe: Probe = NO_PROBE):
        """``cfg``: the validated experiment config, its batch plan resolved by the driver
        (``plan.batching``; an unresolved one is refused); ``clients``: ``[{"cid", "train", "test"[, "val"]}]``
        (or the :class:`~fedsweep.actors.inputs.Kept` file that holds them, as ``pool`` may be); ``restore_from``:
        the checkpoint round folder to start from (the runner verified it; after a restart the server
        moves the actor to the round it last committed); ``pool``: the held-out validation pool (methods
        whose capabilities ask for one); ``group``: this process's
        :class:`~fedsweep.actors.shard_group.ShardGroup` in a sharded client (``actors.sharded``);
        ``probe``: asked at the call boundaries (``actors.probe``; a run's does nothing)."""
        if not isinstance(cfg, ExperimentConfig):
            raise TypeError(f"ClientActor takes a validated ExperimentConfig, got {type(cfg).__name__}")
        self.started = {"module_ready": MODULE_READY, "init_start": time.time()}
        clients, pool = loaded(clients), loaded(pool)  # (a run's actor reads them from its run folder: actors.inputs)
        self.cfg, self.batch_plan = cfg, cfg.batch_plan()  # (refuses a plan the driver did not resolve)
        self.settings = settings_from(cfg)
        res = cfg.clients.resources
        torch.set_num_threads(res.torch_threads or max(1, int(res.num_cpus)))
        self.device = device_of(res)
        models = {cfg.client_models()[c["cid"]] for c in clients} or {cfg.model.name}
        if len(models) > 1:
            raise ValueError(f"one ClientActor hosts clients of one base model, got {sorted(models)}")
        all_ranks = cfg.client_ranks() if cfg.adapter == "lora" else [cfg.reft.rank] * cfg.clients.num_clients
        ranks = sorted({all_ranks[c["cid"]] for c in clients}) or [all_ranks[0]]
        self.base = build_base(cfg, self.settings, models.pop(), ranks, self.device, group)
        self.started["base_built"] = time.time()  # (the model loaded, its adapters attached)
        self.probe = probe
        self.algo = registry.create(cfg.algorithm, cfg.algo_params)
        self.init_params = {r: self.base.adapters.initial(r) for r in ranks}
        self.preference = self.settings.preference
        self.slots: dict[int, ClientSlot] = {c["cid"]: self._slot(c, all_ranks[c["cid"]]) for c in clients}
        self.hooks = MethodHooks(cfg, self.base, self.algo, self.slots, self.init_params, pool, self.device)
        self.versions = BaseVersions(self.base, self.slots)
        self.evaluation = ClientEvaluation(cfg, self.base, self.algo, self.slots, self.hooks, self.versions,
                                           self.batch_plan.clients, self.preference)
        self.saves = ClientSaves(self.slots)
        self.training = ClientTraining(self.base, self.algo, self.slots, self.hooks, self.versions,
                                       ClientChain(cfg))
        self.restored_round = 0
        self.incarnation_token = uuid.uuid4().hex  # a restarted actor is a new incarnation
        if self.batch_plan.reason and len(clients) > 1:
            print(f"fedsweep: clients of this actor train one at a time: {self.batch_plan.reason}",
                  file=sys.stderr, flush=True)
        if restore_from and not restarted():  # the one restore rule: see :func:`restarted`
            self.restore(restore_from)
        if cfg.eval.max_new_tokens > 0:  # the answers' scorers load beside the first round's training
            tests = [r for c in clients for r in c["test"]]
            threading.Thread(target=warm_scorers, args=(tests,), name="fedsweep-scorers", daemon=True).start()
        self.started["init_end"] = time.time()

    def _slot(self, c: dict[str, Any], rank: int) -> ClientSlot:
        enc = self.base.encode
        slot = ClientSlot(c["cid"], c["train"], c["test"], enc(c["train"]), enc(c["test"]),
                          clone(self.init_params[rank]), rank, val_enc=enc(c.get("val", [])))
        if self.preference:
            slot.train_pref = self.base.encode_preferences(c["train"])
            slot.test_pref = self.base.encode_preferences(c["test"])
        return slot

    # the model side, for callers that inspect it
    @property
    def model(self):
        return self.base.model

    @property
    def adapters(self):
        return self.base.adapters

    @property
    def tokenizer(self):
        return self.base.tokenizer

    # ------------------------------------------------------------------ plumbing
    def ping(self) -> list[int]:
        return sorted(self.slots)

    def start_times(self) -> dict[str, float]:
        """Epoch seconds of this process's start, its imports done, and construction begun and done."""
        from fedsweep.process_start import process_start_epoch

        return {"process_start": process_start_epoch(), **self.started}

    def frozen_objects(self) -> int:
        """How many objects this process's construction froze (:mod:`fedsweep.actors.heap`)."""
        import gc

        return gc.get_freeze_count()

    def incarnation(self) -> dict[str, Any]:
        """Which life of this actor answers (its token: new in each process, and after each :meth:`rewind`)."""
        return {"token": self.incarnation_token}

    def node_id(self) -> str:
        """The Ray node this actor runs on (empty outside Ray)."""
        try:
            return ray.get_runtime_context().get_node_id()
        except Exception:
            return ""

    def initial_params(self) -> Params:
        """θ_0 of the first hosted client's rank (the global start of global methods)."""
        first = self.slots[min(self.slots)] if self.slots else None
        return clone(self.init_params[first.rank if first else min(self.init_params)])

    def client_params(self, cid: int) -> Params:
        return clone(self.slots[cid].params)

    # ------------------------------------------------------------------ training
    def _train_group(self, rnd: int, work: list[tuple[int, Payload]]) -> dict[int, ClientResult]:
        """Local training of ``work`` (clients with their payloads; one base version) as one group of
        the engine (``engine.training``): one step loop over all of them, each with its own adapter.
        Each client's ``train_seconds`` is an equal share of the whole."""
        self.saves.wait_copied()
        self.probe.before_train(rnd, [cid for cid, _ in work])
        results = self.training.train_group(rnd, work)
        self.probe.after_train(rnd, results, self.slots)
        return results

    def train(self, rnd: int, cid: int, payload: Payload) -> ClientResult:
        """One round of local training for client ``cid`` alone (a group of one); returns its upload
        and metrics. Errors are raised, not reported."""
        return self._train_group(rnd, [(cid, payload)])[cid]

    def train_many(self, rnd: int, items: list[tuple[int, int]], *payloads: Payload,
                   partial_sum: bool = False) -> tuple:
        """Local training of several of this actor's clients in one call: ``items`` pairs a client with
        the index of its payload in ``payloads`` (clients sharing a payload share one object). Clients
        train in groups of up to the batch plan's size (``train.batch_clients``; clients of one base
        version; a payload with DP-SGD alone), the groups one after another. A client whose
        training raises does not stop the others: its entry is the error's one-line description
        instead of a result (a failed group: each of its clients', for the server to retry alone).
        Returns this actor's incarnation token (the server replays what a since-restarted
        incarnation trained) and the entries; with ``partial_sum``, also one weighted partial sum of the
        trained clients' uploads (``federation.chain.partial_sum``), their results carrying the norms
        screening needs instead of the uploads (kept here for :meth:`uploads`)."""
        done: dict[int, ClientResult | str] = {}
        for group in training_groups(items, payloads, self.batch_plan.clients):
            try:
                done.update(self._train_group(rnd, group))
            except Exception as exc:  # noqa: BLE001  (each of its clients is retried alone)
                done.update(dict.fromkeys([cid for cid, _ in group], one_line(exc)))
        entries = [(cid, done[cid]) for cid, _ in items]
        if not partial_sum:
            return self.incarnation_token, entries
        partial, kept = summed_uploads(items, payloads, done)
        self._uploads = round_uploads(getattr(self, "_uploads", None), rnd, kept)
        return self.incarnation_token, entries, partial

    def uploads(self, rnd: int, cids: list[int]) -> dict[int, Params]:
        """The uploads of ``cids`` this actor summed in round ``rnd`` (the server asks where screening left
        one of them out)."""
        kept_rnd, kept = getattr(self, "_uploads", (None, {}))
        missing = [cid for cid in cids if kept_rnd != rnd or cid not in kept]
        if missing:
            raise LookupError(f"round {rnd}: no upload of clients {missing} kept (this actor's life trained others)")
        return {cid: kept[cid] for cid in cids}

    def local_steps(self, cid: int) -> int:
        """``train.steps``, or ``train.epochs`` over client ``cid``'s training examples in batches."""
        return self.settings.steps_for(len(self.slots[cid].train_enc))

    def batch_order(self, rnd: int, cid: int, steps: int) -> torch.Tensor:
        """Indices into client ``cid``'s training examples for ``steps`` batches of round ``rnd``."""
        return batch_order(self.settings, rnd, cid, len(self.slots[cid].train_enc), steps)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, rnd: int, cid: int, payload: Payload) -> dict[str, float]:
        """Test loss over the client's whole test split and, unless ``eval.max_new_tokens`` is 0, task
        accuracy (greedy generation, the task's scorer) on its first ``eval.max_examples`` test
        records; DPO reward margins of its test pairs (an evaluation group of one)."""
        return self.evaluate_many(rnd, [([cid], payload)])[1][cid]

    def evaluate_many(self, rnd: int, groups: list[tuple[list[int], Payload]]) -> tuple[str, dict[int, dict[str, float]]]:
        """:meth:`evaluate` for several of this actor's clients in one call (``client_eval``): ``groups``
        pairs clients with the evaluation payload they share. Returns this actor's incarnation token
        (the server re-asks a life it has not adopted) and the metrics by client."""
        self.saves.wait_copied()  # (a method's evaluation hooks see the clients' state)
        self.probe.before_evaluate(rnd, [cid for cids, _ in groups for cid in cids])
        return self.incarnation_token, self.evaluation.evaluate_many(rnd, groups)

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str, previous: str | None = None, defer: bool = False) -> dict[str, Any]:
        """Write every hosted client's state into ``directory`` (``client_saves``; ``defer``: answer at
        once, the files written on this actor's writer threads, :meth:`saved` returns their digests)."""
        rnd, first = round_of(directory), (min(self.slots) if self.slots else -1)
        self.probe.before_save(rnd, first)
        answer, pending = self.saves.save(directory, previous, defer, self.incarnation_token)
        if pending is not None:
            self.probe.after_deferred_save(rnd, first, lambda job: self.saves.write_beside(pending, job))
        return answer

    @ray.method(concurrency_group="checkpoint")
    def saved(self, directory: str) -> dict[str, Any]:
        """The digests of a deferred :meth:`save` into ``directory``, once its files are written (runs
        beside training, in its own concurrency group). Raises LookupError when this incarnation has
        no such save (the one that made it died)."""
        return self.saves.saved(directory)

    def restore(self, directory: str) -> None:
        self.saves.wait_copied()
        self.restored_round = restore_slots(self.slots, directory)

    def rewind(self, directory: str | None) -> dict[str, Any]:
        """Back to the committed round in ``directory``, for a new server actor or for a new life of this
        actor the server adopts: deferred saves written and forgotten, then :meth:`restore`; ``None`` (no
        round committed yet): every client as built, the base at W_0. Returns :meth:`incarnation`, a new
        token: what it answered before was computed on state the rewind undid (the server asks again)."""
        self.saves.forget()
        if directory is not None:
            self.restore(directory)
        else:
            self.versions.reset()
            for slot in self.slots.values():
                slot.params, slot.opt_state, slot.algo_state = clone(self.init_params[slot.rank]), None, {}
                slot.algo_meta, slot.codec_residual, slot.rounds_trained, slot.saved_as = {}, {}, 0, None
            self.restored_round = 0
        self.incarnation_token = uuid.uuid4().hex
        return self.incarnation()


def restarted() -> bool:
    """Whether this process is an actor Ray restarted after it died. Ray runs the constructor again
    with the arguments it was first given, whose ``restore_from`` names the round the actor was built
    from; by now pruning may have removed it. A restarted actor therefore restores nothing when built:
    the server restores every new incarnation from the newest committed round
    (``RoundCheckpoints.restore_committed``), the only round it ever tells an actor to restore from,
    which pruning never removes."""
    if not ray.is_initialized():  # an actor built in-process (benchmarks, tests): never restarted
        return False
    import warnings

    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return False
    with warnings.catch_warnings():  # (Ray 2.60's property reads its own deprecated actor_id)
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(context.was_current_actor_reconstructed)
