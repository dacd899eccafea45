"""FedAvg (McMahan et al. 2017) and FedIT (FedAvg over LoRA factors, Zhang et al. 2024)."""

from __future__ import annotations

from fedsweep.algorithms.base import Algorithm, ClientResult, Report, ServerState, weighted_mean
from fedsweep.algorithms.registry import register


@register
class FedAvg(Algorithm):
    """θ_g = Σ_k n_k θ_k / Σ_k n_k over the sampled clients; LoRA A and B averaged separately."""

    name = "fedavg"
    summary = "weighted mean of client adapters by local example count"

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
        params = [r.upload.params for r in results]
        weights = [r.num_examples for r in results]
        state.globals = weighted_mean(params, weights)
        return state, Report(metrics={"clients_aggregated": float(len(results))})


@register
class FedIT(FedAvg):
    """FedIT is FedAvg applied to LoRA adapters (ALGORITHMS.md, Baselines)."""

    name = "fedit"
    summary = "FedAvg over LoRA factors (alias of fedavg)"
