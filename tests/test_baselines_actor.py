"""Baselines that change what a client trains or holds, on the real ClientActor (in-process)."""

from __future__ import annotations

import pytest

from fedsweep.algorithms.types import ServerContext
import torch

from fedsweep.algorithms import create
from fedsweep.algorithms.types import ClientInfo, ClientResult
from fedsweep.data import bundled
from fedsweep.data.partition import make_clients
from fedsweep.config import validate
from fedsweep.orchestrator.runner import prepare_clients

from in_process import client_actor

TASKS = ["basic_arithmetic", "gcd", "leg_counting", "spell_backward"]


def _cfg(algorithm: str, **lora) -> dict:
    return {"name": "b", "algorithm": algorithm, "lora": {"r": 4, **lora}, "train": {"steps": 3, "learning_rate": 0.01},
            "data": {"tasks": TASKS}, "partition": {"scheme": "task"}, "clients": {"num_clients": 4}}


@pytest.fixture(scope="module")
def clients():
    recs = bundled.generate(TASKS, 12, 0)
    return [dict(cid=c.cid, train=c.train, test=c.test) for c in make_clients(recs, "task", 4, seed=0, test_fraction=0.25)]


def test_ffa_lora_never_changes_a_and_uploads_only_b(clients):
    actor = client_actor(validate(_cfg("ffa_lora")), clients[:1])
    algo = create("ffa_lora")
    state = algo.init(actor.initial_params(), ServerContext())
    result = actor.train(1, 0, algo.dispatch(1, [0], state)[0])
    after = actor.client_params(0)
    for k, v in after.items():
        if "lora_A" in k:
            assert torch.equal(v, state.globals[k])
    assert set(result.upload.params) == {k for k in after if "lora_B" in k}
    assert any(not torch.equal(after[k], state.globals[k]) for k in result.upload.params)
    state, _ = algo.aggregate(1, [result], state)
    assert all(torch.equal(state.globals[k], after[k]) for k in result.upload.params)


def test_fedsa_lora_shares_a_and_keeps_b_local(clients):
    actor = client_actor(validate(_cfg("fedsa_lora")), clients[:2])
    algo = create("fedsa_lora")
    state = algo.init(actor.initial_params(), ServerContext())
    payloads = algo.dispatch(1, [0, 1], state)
    results = [actor.train(1, c, payloads[c]) for c in (0, 1)]
    assert all(all("lora_A" in k for k in r.upload.params) for r in results)
    state, _ = algo.aggregate(1, results, state)
    b0 = {k: v for k, v in actor.client_params(0).items() if "lora_B" in k}
    actor.train(2, 0, algo.dispatch(2, [0], state)[0])  # starts from averaged A and its own B
    start = algo.client_prepare(actor.hooks.context(2, actor.slots[0], algo.dispatch(2, [0], state)[0]),
                                algo.dispatch(2, [0], state)[0])
    assert all(torch.equal(start[k], state.globals[k]) for k in state.globals)
    assert all(torch.equal(start[k], actor.slots[0].params[k]) for k in b0)


def test_mixed_ranks_share_one_base_and_flora_merges_it_once(clients):
    cfg = _cfg("flora", ranks=[2, 4, 8, 2])
    packed = client_actor(validate(cfg), clients)  # ranks 2, 4, 8 as three adapters on one base
    alone = client_actor(validate(cfg), clients[1:2])
    assert {s.rank for s in packed.slots.values()} == {2, 4, 8}
    algo = create("flora")
    infos = [ClientInfo(i, 10, rank=r, lora_scale=16 / r) for i, r in enumerate([2, 4, 8, 2])]
    state = algo.init({}, ServerContext(infos))
    for rnd in (1, 2):
        payloads = algo.dispatch(rnd, [0, 1, 2, 3], state)
        results = [packed.train(rnd, c, payloads[c]) for c in range(4)]
        solo = alone.train(rnd, 1, payloads[1])
        # the client computes the same on a shared base as alone: the merge is applied once per version
        assert all(torch.equal(solo.upload.params[k], results[1].upload.params[k]) for k in solo.upload.params)
        assert results[2].upload.params["model.layers.0.self_attn.q_proj.lora_A.weight"].shape[0] == 8
        state, _ = algo.aggregate(rnd, results, state)
    m = "model.layers.0.self_attn.q_proj"
    base = dict(__import__("fedsweep.models.lora", fromlist=["x"]).base_weights(packed.model))[m]
    packed.versions.apply(algo.dispatch(3, [0], state)[0])
    torch.testing.assert_close(base.detach(), packed.versions._w0[m] + state.buffers["base"][m])


def test_centralized_trains_one_client_on_the_union_with_the_federation_budget():
    cfg = validate({**_cfg("centralized"), "data": {"tasks": TASKS, "examples_per_task": 12}})
    parts, _ = prepare_clients(cfg)
    fed, _ = prepare_clients(validate({**_cfg("fedavg"), "data": {"tasks": TASKS, "examples_per_task": 12}}))
    assert len(parts[0].train) == sum(len(c.train) for c in fed) and all(not c.train for c in parts[1:])
    assert [c.test for c in parts] == [c.test for c in fed]
    algo = create("centralized")
    payloads = algo.dispatch(1, [0, 1, 2, 3], algo.init({}, ServerContext()))
    assert list(payloads) == [0] and payloads[0].steps_scale == 4
    actor = client_actor(cfg, [dict(cid=0, train=parts[0].train, test=parts[0].test)])
    result = actor.train(1, 0, payloads[0].__class__(params=actor.initial_params(), steps_scale=4))
    assert result.metrics["steps"] == 12.0
    assert isinstance(result, ClientResult)
