"""A method's own work grouped like its training (``fedsweep bench throughput --ops``'s method round): the
operator calls of a round's client side — the method's preparation (FedReFT+'s α grid, pFedGPT's HBO
scoring), local training, its upload work (FedCoFiT's generation, FedICU's masks) and evaluation — of
K = 50 clients on one actor make at most twice one client's (a GPU's launches grow with layers, not with
clients); pFedGPT's Ax fits are counted apart.

The counts are exact and grow linearly with the clients (each client's share of a step is its rows), so
the suite checks a round of 6 clients against the same bound extrapolated (calls(6) − calls(1) ≤
(5/49)·calls(1), which is calls(50) ≤ 2·calls(1) for linear growth); the long suite counts K = 50 itself."""

from __future__ import annotations

import pytest

from fedsweep.bench.method_round import method_round
from fedsweep.config import load_config

SETTINGS = ["train.steps=2", "data.examples_per_task=120", "partition.scheme=iid", "train.forwards=one",
            "eval.forwards=one", "eval.max_new_tokens=0"]
METHODS = {
    "fedavg": [],
    "drift": ["algorithm=drift"],
    "fedicu": ["algorithm=fedicu"],
    "fedreft": ["algorithm=fedreft", "adapter=reft", "reft.rank=2", "data.val_fraction=0.2"],
    "fedcofit": ["algorithm=fedcofit", "fedcofit.public_prompts=4", "fedcofit.max_new_tokens=4"],
    "pfedgpt": ["algorithm=pfedgpt", "pfedgpt.slow_start=false", "pfedgpt.stage1_trials=2", "pfedgpt.init_trials=1",
                "pfedgpt.stage2_trials=1", "pfedgpt.validation_size=4", "data.holdout_fraction=0.2"],
}


def _calls(method: str, k: int, host: bool = True) -> dict:
    return method_round(load_config("configs/experiments/smoke.yaml", SETTINGS + METHODS[method]), k, host)


@pytest.mark.xdist_group("method_ops")
@pytest.mark.parametrize("method", list(METHODS))
def test_a_methods_round_grows_with_its_clients_at_most_as_twice_one_clients_at_fifty(method):
    one, six = _calls(method, 1), _calls(method, 6)
    grown = six["round_model_aten_calls"] - one["round_model_aten_calls"]
    assert grown <= 5 / 49 * one["round_model_aten_calls"], (method, one["round_model_aten_calls"],
                                                             six["round_model_aten_calls"])
    if method == "pfedgpt":  # its Ax, apart: each client's own searches (fits and acquisitions)
        assert six["round_host_aten_calls"] > 5 * one["round_host_aten_calls"] > 0


@pytest.mark.long
@pytest.mark.xdist_group("method_ops")
@pytest.mark.parametrize("method", list(METHODS))
def test_a_methods_round_of_fifty_clients_makes_at_most_twice_one_clients_calls(method):
    one, fifty = _calls(method, 1, host=False), _calls(method, 50, host=False)  # (pFedGPT's HBO: 4.9M host calls)
    assert fifty["round_model_aten_calls"] <= 2 * one["round_model_aten_calls"], (method, one, fifty)
    assert fifty["round_model_compute_calls"] <= 2 * one["round_model_compute_calls"], (method, one, fifty)
