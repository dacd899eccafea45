"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data")."""

from __future__ import annotations

from fedsweep.algorithms.base import Algorithm, Capabilities
from fedsweep.algorithms.types import AggregationContext, ClientResult, PLAIN, Report, ServerState
from fedsweep.algorithms.registry import register


@register
class FedAvg(Algorithm):
    """θ_g = Σ_k n_k θ_k / Σ_k n_k over the sampled clients; LoRA A and B averaged separately."""

    name = "fedavg"
    summary = "weighted mean of client adapters by local example count"
    capabilities = Capabilities(averages_uploads=True, partial_sums=True)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        params = [r.upload.params for r in results]
        weights = [r.num_examples for r in results]
        state.globals = ctx.mean(params, weights)
        return state, Report(metrics={"clients_aggregated": float(len(results))})
