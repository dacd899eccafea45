"""FedAvg and local against independent computations."""

from __future__ import annotations

import numpy as np
import torch

from fedsweep.algorithms import create
from fedsweep.algorithms.tensors import weighted_mean
from fedsweep.algorithms.types import ClientInfo, ClientResult, ServerContext, Upload, payload_bytes, upload_bytes


def _client_sets(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"l0.q_proj.lora_A.weight": torch.randn(4, 16, generator=g),
             "l0.q_proj.lora_B.weight": torch.randn(16, 4, generator=g)} for _ in range(k)]


def test_fedavg_equals_weighted_mean_by_example_count():
    sets, n = _client_sets(5), [3, 10, 1, 7, 40]
    algo = create("fedavg")
    state = algo.init(sets[0], ServerContext([ClientInfo(i, n[i]) for i in range(5)]))
    results = [ClientResult(cid=i, num_examples=n[i], upload=Upload(params=sets[i])) for i in range(5)]
    state, report = algo.aggregate(1, results, state)
    for key in sets[0]:  # independent: float64 numpy loop
        expected = sum(n[i] * sets[i][key].double().numpy() for i in range(5)) / sum(n)
        np.testing.assert_allclose(state.globals[key].numpy(), expected, rtol=1e-6, atol=1e-6)
    assert report.metrics["clients_aggregated"] == 5


def test_fedavg_averages_lora_factors_separately_not_their_product():
    sets = _client_sets(2)
    avg = create("fedavg").aggregate(1, [ClientResult(i, 1, Upload(params=s)) for i, s in enumerate(sets)],
                                     create("fedavg").init(sets[0], ServerContext()))[0].globals
    a = "l0.q_proj.lora_A.weight"
    b = "l0.q_proj.lora_B.weight"
    np.testing.assert_allclose(avg[a], (sets[0][a] + sets[1][a]) / 2, atol=1e-6)
    product_mean = (sets[0][b] @ sets[0][a] + sets[1][b] @ sets[1][a]) / 2
    assert not torch.allclose(avg[b] @ avg[a], product_mean, atol=1e-3)


def test_dispatch_sends_one_object_to_all_clients():
    sets = _client_sets(1)
    algo = create("fedavg")
    payloads = algo.dispatch(1, [0, 2, 5], algo.init(sets[0], ServerContext()))
    assert len({id(p) for p in payloads.values()}) == 1
    assert payload_bytes(payloads[0]) == (4 * 16 + 16 * 4) * 4


def test_local_sends_nothing_and_keeps_nothing():
    algo = create("local")
    state = algo.init(_client_sets(1)[0], ServerContext())
    assert state.globals is None
    assert all(p.params is None for p in algo.dispatch(1, [0, 1], state).values())
    assert upload_bytes(algo.client_upload(None, _client_sets(1)[0])) == 0


def test_weighted_mean_rejects_bad_weights():
    import pytest

    with pytest.raises(ValueError):
        weighted_mean(_client_sets(2), [1.0])
    with pytest.raises(ValueError):
        weighted_mean(_client_sets(2), [0.0, 0.0])
