"""Evaluation of packed clients with their own adapters in shared batches, against each client's
solo evaluation (the independent computation: peft's adapter for that client alone).

Clients of ranks 2, 4, 8, 2 with distinct random adapters; ``eval.batch_size`` 3 so that batches
straddle clients in runs of unequal length (the gathered-factor path) as well as equal ones.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fedsweep.actors.client import ClientActor
from fedsweep.actors.stacked_evaluation import StackedEvaluation, row_groups
from fedsweep.algorithms.types import Payload
from fedsweep.config import validate
from fedsweep.models.stacked_lora import RowGroup
from fedsweep.orchestrator.experiment_data import prepare_data

RAW = {"name": "stacked-eval", "seed": 0, "algorithm": "flexlora",  # mixed ranks; evaluated with own adapters
       "model": {"name": "tiny"},
       "lora": {"ranks": [2, 4, 8, 2], "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
       "data": {"tasks": ["basic_arithmetic", "leg_counting", "spell_backward", "gcd"], "examples_per_task": 12,
                "test_fraction": 0.25},
       "partition": {"scheme": "task"}, "clients": {"num_clients": 4, "clients_per_actor": 4},
       "train": {"steps": 1, "batch_size": 3, "max_length": 96},
       "eval": {"max_new_tokens": 6, "batch_size": 3}, "checkpoint": {"enabled": False},
       "tracking": {"enabled": False}}


def _actor(batch_clients: str) -> ClientActor:
    raw = copy.deepcopy(RAW)
    raw["train"]["batch_clients"] = batch_clients
    cfg = validate(raw)
    clients, _, _ = prepare_data(cfg)
    actor = ClientActor(cfg, [{"cid": c.cid, "train": c.train, "test": c.test} for c in clients])
    gen = torch.Generator().manual_seed(5)
    for slot in actor.slots.values():  # distinct adapters, large enough to change the answers
        slot.params = {k: torch.randn(v.shape, generator=gen) * 0.4 for k, v in slot.params.items()}
    return actor


def test_row_groups_are_the_runs_of_owners():
    assert row_groups([0, 0, 1, 3, 3, 3, 0]) == [RowGroup(0, 2, 0), RowGroup(1, 1, 0), RowGroup(3, 3, 0),
                                                  RowGroup(0, 1, 0)]


def test_personalised_evaluation_in_shared_batches_equals_each_client_alone(monkeypatch):
    stacked, alone = _actor("auto"), _actor("off")
    calls = []
    run = ClientActor._evaluate_stacked
    monkeypatch.setattr(ClientActor, "_evaluate_stacked",
                        lambda self, rnd, items: calls.append([c for c, _ in items]) or run(self, rnd, items))
    groups = [([cid], Payload()) for cid in sorted(stacked.slots)]
    _, got = stacked.evaluate_many(1, groups)
    _, want = alone.evaluate_many(1, groups)
    assert calls == [sorted(stacked.slots)]  # one stacked evaluation of all four; none on the "off" actor
    assert got.keys() == want.keys()
    for cid, metrics in want.items():
        assert got[cid]["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)
        for key in ("accuracy", "num_test", "num_test_loss"):
            assert got[cid][key] == metrics[key], (cid, key)
    assert len({round(m["test_loss"], 4) for m in want.values()}) == 4  # the clients really differ


def test_generation_with_per_row_adapters_equals_each_adapter_alone():
    actor = _actor("auto")
    t = actor.trainer
    slots = list(actor.slots.values())
    prompts = [r["prompt"] for r in slots[0].test[:2]] + [slots[2].test[0]["prompt"]]
    ev = StackedEvaluation(t, [s.rank for s in slots], [s.params for s in slots])
    # the same prompts for every client, one client's set cut short: runs of 3, 3, 2, 3 across batches of 3
    sets = [prompts, prompts, prompts[:2], prompts]
    got = ev.generate(sets)  # eval.max_new_tokens: 6
    solo = []
    for slot, some in zip(slots, sets):
        t._load(slot.rank, slot.params)
        solo.append(t.generate(some, 6))
    assert got == solo
    assert len({tuple(answers[:2]) for answers in solo}) > 1  # the adapters change the answers
