"""Evaluation groups of packed clients, each with its own adapter, against each client alone computed
by peft's own LoRA layers (the independent computation: the engine's stacks are switched off and
peft's adapter of that client's rank holds its tensors).

Clients of ranks 2, 4, 8, 2 with distinct random adapters; ``eval.batch_size`` 3 so that forwards
straddle clients in runs of unequal length (the gathered-factor path) as well as equal ones.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from fedsweep.actors.client import ClientActor
from fedsweep.algorithms.types import Payload
from fedsweep.config import validate
from fedsweep.engine import evaluation
from fedsweep.engine.objectives import sequence_logps
from fedsweep.engine.text import collate, pair_rows, token_loss_sum
from fedsweep.models import lora
from fedsweep.orchestrator.experiment_data import prepare_data

from in_process import client_actor

RAW = {"name": "stacked-eval", "seed": 0, "algorithm": "flexlora",  # mixed ranks; evaluated with own adapters
       "model": {"name": "tiny"},
       "lora": {"ranks": [2, 4, 8, 2], "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
       "data": {"tasks": ["basic_arithmetic", "leg_counting", "spell_backward", "gcd"], "examples_per_task": 12,
                "test_fraction": 0.25},
       "partition": {"scheme": "task"}, "clients": {"num_clients": 4, "clients_per_actor": 4},
       "train": {"steps": 1, "batch_size": 3, "max_length": 96},
       "eval": {"max_new_tokens": 6, "batch_size": 3}, "checkpoint": {"enabled": False},
       "tracking": {"enabled": False}}


CUDA = __import__("os").environ.get("FEDSWEEP_TEST_DEVICE") == "cuda"
"""``make gpu-check``'s equality step: the actors on the GPU (it runs the one-forward test, whose two sides
are both the engine's; the others compare with peft on CPU tensors)."""


def _actor(batch_clients: str, **extra) -> ClientActor:
    raw = copy.deepcopy(RAW)
    if CUDA:
        raw["clients"] = {**raw["clients"], "resources": {"num_gpus": 1}}
    raw["train"]["batch_clients"] = batch_clients
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    cfg = validate(raw)
    clients, _, _ = prepare_data(cfg)
    actor = client_actor(cfg, [{"cid": c.cid, "train": c.train, "test": c.test} for c in clients])
    gen = torch.Generator().manual_seed(5)
    for slot in actor.slots.values():  # distinct adapters, large enough to change the answers
        slot.params = {k: torch.randn(v.shape, generator=gen) * 0.4 for k, v in slot.params.items()}
    return actor


@contextlib.contextmanager
def peft_alone(actor: ClientActor, slot):
    """peft's own LoRA layers on, with ``slot``'s adapter in its rank's adapter."""
    model, name = actor.model, lora.adapter_name(slot.rank)
    model.base_model.enable_adapter_layers()
    model.set_adapter(name)
    lora.write_adapter(model, slot.params, name)
    try:
        yield model
    finally:
        model.base_model.disable_adapter_layers()


def _peft_loss(actor: ClientActor, slot) -> float:
    total = count = 0.0
    with torch.no_grad(), peft_alone(actor, slot) as model:
        for ex in slot.test_enc:
            batch = collate([ex], actor.tokenizer.pad_token_id)
            s, c = token_loss_sum(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                  batch["labels"])
            total, count = total + float(s), count + c
    return total / count


def _peft_answers(actor: ClientActor, slot, prompts: list[str], n: int) -> list[str]:
    with peft_alone(actor, slot):
        return actor.base.generate(prompts, n)


def test_personalised_evaluation_in_groups_equals_each_client_alone_by_peft(monkeypatch):
    grouped = _actor("auto")
    calls = []
    run = evaluation.evaluate_group
    monkeypatch.setattr("fedsweep.actors.client_eval.evaluate_group",
                        lambda base, ranks, params, clients: calls.append(len(ranks)) or run(base, ranks, params, clients))
    groups = [([cid], Payload()) for cid in sorted(grouped.slots)]
    _, got = grouped.evaluate_many(1, groups)
    assert calls == [4]  # one evaluation group of all four, four adapters
    for cid, metrics in got.items():
        slot = grouped.slots[cid]
        assert metrics["test_loss"] == pytest.approx(_peft_loss(grouped, slot), rel=1e-5)
        answers = _peft_answers(grouped, slot, [r["prompt"] for r in slot.test], 6)
        assert metrics["accuracy"] == pytest.approx(sum(
            __import__("fedsweep.data.bundled", fromlist=["score"]).score(r, a) for r, a in zip(slot.test, answers))
            / len(slot.test))
    assert len({round(m["test_loss"], 4) for m in got.values()}) == 4  # the clients really differ
    alone = _actor("off")  # groups of one give the same figures
    calls.clear()
    _, want = alone.evaluate_many(1, groups)
    assert calls == [1, 1, 1, 1]
    for cid in got:
        assert got[cid]["test_loss"] == pytest.approx(want[cid]["test_loss"], rel=1e-5)
        assert got[cid]["accuracy"] == want[cid]["accuracy"]


def test_generation_with_per_row_adapters_equals_each_adapter_alone():
    actor = _actor("auto")
    slots = list(actor.slots.values())
    prompts = [r["prompt"] for r in slots[0].test[:2]] + [slots[2].test[0]["prompt"]]
    # the same prompts for every client, one client's set cut short: runs of 3, 3, 2, 3 across batches of 3
    sets = [prompts, prompts, prompts[:2], prompts]
    clients = [evaluation.EvalClient(k, prompts=some) for k, some in enumerate(sets)]
    got = evaluation.evaluate_group(actor.base, [s.rank for s in slots], [s.params for s in slots], clients)
    solo = [_peft_answers(actor, slot, some, 6) for slot, some in zip(slots, sets)]
    assert [g.answers for g in got] == solo
    assert len({tuple(answers[:2]) for answers in solo}) > 1  # the adapters change the answers


def test_dpo_margins_in_a_group_equal_each_client_by_peft():
    """DPO reward margins of four clients' test pairs in one group: each client's equal
    β[(π_c − r_c) − (π_r − r_r)] computed with peft's layers (π) and with them off (r), pair by pair."""
    actor = _actor("auto", data={"kind": "preference"}, train={"objective": "dpo", "dpo_beta": 0.2},
                   algorithm="drift", lora={"ranks": None, "r": 4})
    assert actor.batch_plan.clients == 4
    _, got = actor.evaluate_many(1, [([cid], Payload()) for cid in sorted(actor.slots)])
    for cid, metrics in got.items():
        slot = actor.slots[cid]
        margins = []
        for pair in slot.test_pref:
            rows = pair_rows([pair], actor.tokenizer.pad_token_id)
            with torch.no_grad():
                reference = sequence_logps(actor.model(input_ids=rows["input_ids"],
                                                       attention_mask=rows["attention_mask"]).logits,
                                           rows["input_ids"], rows["completion_mask"])
                with peft_alone(actor, slot) as model:
                    policy = sequence_logps(model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits,
                                            rows["input_ids"], rows["completion_mask"])
            margins.append(0.2 * float((policy[0] - reference[0]) - (policy[1] - reference[1])))
        assert metrics["dpo_reward_margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-4, abs=1e-6)
        assert metrics["dpo_reward_accuracy"] == pytest.approx(sum(m > 0 for m in margins) / len(margins))


@pytest.mark.parametrize("owners", [[0, 0, 1, 1, 2, 2, 3, 3],   # every client in order: the stacks themselves
                                    [2, 2, 0, 0, 3, 3, 1, 1],   # equal groups out of order: gathered stacks
                                    [0, 1, 1, 2, 3, 3, 0, 2]])  # unequal runs: per-row factors
def test_group_forward_under_bf16_autocast_equals_each_client_by_peft(owners):
    """Under bf16 autocast the engine keeps the LoRA input in bf16 and scales B instead of the product;
    each row's logits still equal peft's own layers for its client under the same autocast (which
    casts the input to float32 and back) to bf16's precision, far closer than two clients differ."""
    actor = _actor("auto")
    slots = [actor.slots[c] for c in sorted(actor.slots)]
    examples = [slots[0].test_enc[i % 2] for i in range(len(owners))]
    batch = collate(examples, actor.tokenizer.pad_token_id)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), actor.base.bind([s.rank for s in slots], [s.params for s in slots]) as binding:
        with binding.rows(owners), autocast:
            grouped = actor.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    alone = {}
    for k, slot in enumerate(slots):
        with torch.no_grad(), peft_alone(actor, slot) as model, autocast:
            alone[k] = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    mask = batch["attention_mask"].bool()
    for i, k in enumerate(owners):
        torch.testing.assert_close(grouped[i][mask[i]], alone[k][i][mask[i]], atol=0.06, rtol=0.02)
    apart = (alone[0] - alone[1]).abs()[mask].max()
    worst = max(float((grouped[i] - alone[k][i]).abs()[mask[i]].max()) for i, k in enumerate(owners))
    assert apart > 10 * max(worst, 0.06), (apart, worst)  # telling clients apart takes far more than the tolerance


@pytest.mark.parametrize("shared", [False, True])
def test_one_forward_evaluation_equals_evaluation_by_length(shared):
    """``eval.forwards: one`` (every row of a group in one forward, every prompt in one generation) and
    ``by_length`` give each client the same test loss (float64: within 1e-12, relative) and the same
    answers, with each client's own adapter and with one shared adapter (a global model)."""
    out = {}
    for how in ("one", "by_length"):
        actor = _actor("auto", model={"name": "tiny", "dtype": "float64"}, eval={"max_new_tokens": 6, "batch_size": 3,
                                                                                  "forwards": how})
        if shared:  # the clients of rank 2 (0 and 3) with client 0's adapter as their global model
            groups = [([c for c, s in actor.slots.items() if s.rank == 2], Payload(params=actor.slots[0].params))]
        else:
            groups = [([cid], Payload()) for cid in actor.slots]
        out[how] = actor.evaluate_many(1, groups)[1]
    assert out["one"].keys() == out["by_length"].keys()
    for cid, m in out["one"].items():
        other = out["by_length"][cid]
        assert abs(m["test_loss"] - other["test_loss"]) <= 1e-12 * abs(other["test_loss"]), (cid, m, other)
        assert m["accuracy"] == other["accuracy"]
