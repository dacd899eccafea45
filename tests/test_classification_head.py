"""FedReFT+'s classification head (its paper's eq. 3–4) against independent computations: the head's
formula written out, the representation it reads taken from the model's own forward, the loss from
scipy-free log-softmax arithmetic, and the generated classification data against the tasks' scorers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsweep.algorithms.types import Payload
from fedsweep.config import validate
from fedsweep.errors import ConfigError

from in_process import client_actor

TASKS = ["basic_arithmetic", "gcd"]


def _cfg(**extra) -> dict:
    cfg = {"name": "cls", "algorithm": "fedreft", "adapter": "reft",
           "reft": {"rank": 2, "first": 2, "last": 2, "tied": True}, "fedreft": {"alpha_tuning": "fixed"},
           "data": {"tasks": TASKS, "kind": "classification"}, "partition": {"scheme": "task"},
           "clients": {"num_clients": 2}, "train": {"steps": 6, "learning_rate": 0.01, "objective": "classify"}}
    for key, value in extra.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def _clients(n_per_task=16, val=0.0):
    from fedsweep.data import bundled
    from fedsweep.data.partition import make_clients

    records = [{**r, "response": r["label"]} for r in bundled.generate_verification(TASKS, n_per_task, 0)]
    parts = make_clients(records, "task", 2, seed=0, test_fraction=0.25, val_fraction=val)
    return [dict(cid=c.cid, train=c.train, test=c.test, val=c.val) for c in parts]


def test_the_head_is_eq_3_written_out():
    """H_ψ(z) = softmax(W_o tanh(W_d z + b_d) + b_o), in float64 by hand, against the module's logits."""
    from fedsweep.models.reft import ClassificationHead

    head = ClassificationHead(6, 3, torch.Generator().manual_seed(0))
    with torch.no_grad():
        head.b_d.copy_(torch.linspace(-0.1, 0.1, 6))
        head.b_o.copy_(torch.tensor([0.3, -0.2, 0.05]))
    z = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    W_d, b_d, W_o, b_o = (t.detach().double().numpy() for t in (head.W_d, head.b_d, head.W_o, head.b_o))
    by_hand = np.tanh(z.double().numpy() @ W_d.T + b_d) @ W_o.T + b_o
    np.testing.assert_allclose(head(z).detach().double().numpy(), by_hand, rtol=1e-5, atol=1e-6)
    probs = torch.softmax(head(z), -1).detach().numpy()
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-6)
    assert head.W_d.std().item() == pytest.approx(0.02, rel=0.15)


def test_the_head_reads_the_last_tokens_final_representation_with_the_interventions():
    """z is the model's final hidden state (after its last norm) at each row's last token: with every
    intervention the identity (W = R, b = 0), class_logits equals the head on ``model.model``'s own last
    hidden state; a row's logits do not depend on the rows padded beside it; and a non-identity
    intervention moves them."""
    actor = client_actor(validate(_cfg()), _clients()[:1])
    base = actor.base
    rows = base.encode(actor.slots[0].train[:3])
    assert [r.label for r in rows] == [["no", "yes"].index(r["label"]) for r in actor.slots[0].train[:3]]
    params = actor.slots[0].params
    identity = {k: (params[k.replace(".W", ".R")].clone() if k.endswith(".W") else
                    torch.zeros_like(v) if k.endswith(".b") else v.clone()) for k, v in params.items()}
    with base.bind([actor.slots[0].rank], [identity]):
        logits = base.class_logits(rows)
        for i, row in enumerate(rows):
            ids = torch.tensor([row.input_ids])
            z = base.model.model(input_ids=ids).last_hidden_state[0, -1]
            torch.testing.assert_close(logits[i], base.adapters.head(z.unsqueeze(0))[0], rtol=1e-4, atol=1e-5)
    with base.bind([actor.slots[0].rank], [params]):
        moved = base.class_logits(rows)
        alone = torch.stack([base.class_logits([r])[0] for r in rows])
    torch.testing.assert_close(moved, alone, rtol=1e-4, atol=1e-5)  # right padding leaves a row alone
    assert not torch.allclose(moved, logits, atol=1e-4)  # the drawn interventions change z


def test_the_objective_is_the_mean_cross_entropy_and_trains_head_and_interventions():
    """eq. 4: each row's −log softmax(H_ψ(z))[y] (by hand from the logits); training lowers the train loss
    and moves the head and the interventions; accuracy is the head's argmax against the label."""
    from fedsweep.engine.objectives import Classify

    clients = _clients()
    actor = client_actor(validate(_cfg()), clients[:1])
    base, slot = actor.base, actor.slots[0]
    rows = slot.train_enc[:4]
    with base.bind([slot.rank], [slot.params]):
        losses, margins = Classify.losses(base, rows)
        logits = base.class_logits(rows).double()
    by_hand = [-(logits[i, r.label] - torch.logsumexp(logits[i], 0)).item() for i, r in enumerate(rows)]
    assert margins is None and losses.detach().double().tolist() == pytest.approx(by_hand, rel=1e-6)
    before = {k: v.clone() for k, v in slot.params.items()}
    loss_before = actor.hooks.split_loss(slot, slot.params, "train")
    result = actor.train(1, slot.cid, Payload())
    after = actor.client_params(slot.cid)
    assert actor.hooks.split_loss(slot, after, "train") < loss_before
    for key in ("reft.head.W_d", "reft.head.W_o", "reft.layers.1.all.W"):
        assert not torch.equal(before[key], after[key]), key
    # FedReFT+ shares W, R and b of the interventions only: the head never leaves the client
    assert result.upload.params and not any(k.startswith("reft.head.") for k in result.upload.params)
    metrics = actor.evaluate(1, slot.cid, Payload())
    with base.bind([slot.rank], [after]):
        predicted = base.class_logits(base.encode(slot.test)).argmax(-1).tolist()
    truth = [["no", "yes"].index(r["label"]) for r in slot.test]
    assert metrics["accuracy"] == pytest.approx(np.mean([p == t for p, t in zip(predicted, truth)]))
    assert math.isfinite(metrics["test_loss"]) and metrics["num_test"] == len(slot.test)  # every test record


def test_fedavg_on_interventions_averages_the_head_too():
    """A baseline that averages every trained tensor (FedAvg on LoReFT) uploads the head with the
    interventions."""
    actor = client_actor(validate(_cfg(algorithm="fedavg", fedreft=None)), _clients()[:1])
    result = actor.train(1, 0, Payload())
    assert {"reft.head.W_d", "reft.head.b_d", "reft.head.W_o", "reft.head.b_o"} <= set(result.upload.params)


def test_generated_classification_data_is_labelled_by_the_tasks_scorers():
    """Half the records (seeded) propose a wrong answer — one the task's scorer grades below 1 — the rest
    their own answer; the same seed gives the same records, another seed others."""
    from fedsweep.data import bundled

    plain = bundled.generate(TASKS, 24, 3)
    records = bundled.generate_verification(TASKS, 24, 3)
    assert len(records) == len(plain) and sum(r["label"] == "no" for r in records) == len(records) // 2
    for r, q in zip(records, plain):
        proposed = r["prompt"].split("\nProposed answer: ")[1].split("\nIs the proposed answer correct?")[0]
        assert r["prompt"].startswith(q["prompt"]) and r["task"] == q["task"]
        assert (bundled.score(q, proposed) == 1.0) == (r["label"] == "yes"), (q["response"], proposed)
    assert bundled.generate_verification(TASKS, 24, 3) == records != bundled.generate_verification(TASKS, 24, 4)


def test_classification_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="set adapter to 'reft'"):
        validate(_cfg(adapter="lora", algorithm="fedavg", fedreft=None))
    with pytest.raises(ConfigError, match="go together"):
        validate(_cfg(train={"objective": "sft"}))
    with pytest.raises(ConfigError, match="go together"):
        validate(_cfg(data={"kind": "instruction"}))
    with pytest.raises(ConfigError, match="distinct"):
        validate(_cfg(data={"labels": ["no", "no"]}))
