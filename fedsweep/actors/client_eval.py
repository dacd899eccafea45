"""A client actor's evaluation: its clients' test loss, accuracy and DPO margins, in groups.

Clients evaluated with one shared payload adapter (the method keeps
:meth:`Algorithm.client_eval_params`' default) and of one rank are one evaluation group with one
adapter; clients evaluated with their own adapters (a personalised method's, or a payload of one
client's) form groups of up to the batch plan's size (one adapter each). A group's ``eval_seconds`` is divided equally among its clients.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fedsweep.algorithms.base import Algorithm
from fedsweep.algorithms.types import Payload
from fedsweep.data.bundled import score
from fedsweep.engine.evaluation import EvalClient, evaluate_group
from fedsweep.engine.rows import chunks


def accuracy(records: list[dict], answers: list[str]) -> dict[str, float]:
    """The share of ``answers`` the task's scorer accepts for ``records``, and how many were scored."""
    return {"accuracy": float(np.mean([score(r, a) for r, a in zip(records, answers)])), "num_test": float(len(records))}


class ClientEvaluation:
    """Evaluation over one actor's clients (``slots``), its base at each payload's version (``versions``)."""

    def __init__(self, cfg, base, algo, slots, hooks, versions, group_size: int, preference: bool) -> None:
        self.cfg, self.base, self.algo, self.slots = cfg, base, algo, slots
        self.hooks, self.versions, self.group_size, self.preference = hooks, versions, group_size, preference

    def evaluate_many(self, rnd: int, groups: list[tuple[list[int], Payload]]) -> dict[int, dict[str, float]]:
        """Metrics by client of ``groups`` (clients paired with the evaluation payload they share)."""
        out: dict[int, dict[str, float]] = {}
        own: dict[Any, list[tuple[int, Payload]]] = {}
        for cids, payload in groups:
            if len(cids) > 1 and self.shares_adapter(cids, payload):
                out.update(self.evaluate_group(rnd, [(cid, payload) for cid in cids], shared=True))
            else:  # (a personal adapter, or one client's: evaluated beside the actor's other clients)
                for cid in cids:
                    own.setdefault(payload.base_version, []).append((cid, payload))
        size = self.group_size if self.base.adapters.groups else 1
        for members in own.values():
            for chunk in chunks(members, max(1, size)):
                out.update(self.evaluate_group(rnd, chunk, shared=False))
        return out

    def shares_adapter(self, cids: list[int], payload: Payload) -> bool:
        own_default = type(self.algo).client_eval_params is Algorithm.client_eval_params
        return own_default and payload.params is not None and len({self.slots[c].rank for c in cids}) == 1

    def evaluate_group(self, rnd: int, members: list[tuple[int, Payload]], shared: bool) -> dict[int, dict[str, float]]:
        """``members`` (clients with their payloads; one base version) evaluated as one group of the
        engine (``engine.evaluation``): with the payload's adapter for all (``shared``), or each with
        its own (``client_eval_params``)."""
        slots = [self.slots[cid] for cid, _ in members]
        self.versions.apply(members[0][1])
        if shared:
            ranks, params = [slots[0].rank], [members[0][1].params]
        else:
            ranks = [s.rank for s in slots]
            params = [self.algo.client_eval_params(self.hooks.context(rnd, s, p), p) for s, (_, p) in zip(slots, members)]
        t0 = time.perf_counter()
        classifying = self.base.settings.classification  # the head's answers need no generation
        generating = self.cfg.eval.max_new_tokens > 0 or classifying
        limit = None if classifying else self.cfg.eval.max_examples  # one forward a record: every test record
        tests = [(s.test[:limit] if limit else s.test) if generating else [] for s in slots]
        pref = self.preference
        clients = [EvalClient(0 if shared else k, examples=s.test_enc, prompts=[r["prompt"] for r in test],
                              pairs=s.test_pref if pref else [],
                              reference=self.versions.reference(s, "test") if pref and s.test_pref else None)
                   for k, (s, test) in enumerate(zip(slots, tests))]
        results = evaluate_group(self.base, ranks, params, clients)
        share = (time.perf_counter() - t0) / len(slots)
        out = {}
        for s, test, r in zip(slots, tests, results):
            m = {"test_loss": r.loss, "num_test_loss": float(len(s.test_enc)),
                 "test_tokens": float(sum(len(e.input_ids) for e in s.test_enc))}  # (the round's ideal reads them)
            if generating:
                m.update(accuracy(test, r.answers))
                m["eval_new_tokens"] = 0.0 if classifying else float(len(test) * self.cfg.eval.max_new_tokens)
            if r.margins is not None:
                m["dpo_reward_margin"] = float(r.margins.mean())
                m["dpo_reward_accuracy"] = float((r.margins > 0).float().mean())
                m["num_test_pref"] = float(len(s.test_pref))
            m["eval_seconds"] = share
            out[s.cid] = m
        return out
