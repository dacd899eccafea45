"""FedAvgM (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification"): server momentum on the pseudo-gradient, v ← β_s v + Δ; θ_g ← θ_g + η_s v."""

from __future__ import annotations

from pydantic import Field

from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams
from fedsweep.algorithms.fedopt import pseudo_gradient
from fedsweep.algorithms.registry import register
from fedsweep.algorithms.types import AggregationContext, ClientResult, PLAIN, Report, ServerState
from fedsweep.lazy import torch


class FedAvgMParams(HyperParams):
    server_lr: float = Field(1.0, gt=0, description="server learning rate η_s")
    server_momentum: float = Field(0.9, ge=0, lt=1, description="server momentum β_s")


@register
class FedAvgM(Algorithm):
    name = "fedavgm"
    Params = FedAvgMParams
    summary = "FedAvg with server momentum on the averaged update"
    capabilities = Capabilities(averages_uploads=True, partial_sums=True)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        delta = pseudo_gradient(results, state.globals, ctx.mean)
        v = state.buffers.get("v") or {k: torch.zeros_like(t) for k, t in delta.items()}
        v = {k: self.hp.server_momentum * v[k] + delta[k] for k in delta}
        state.buffers["v"] = v
        state.globals = {k: state.globals[k] + self.hp.server_lr * v[k] for k in v}
        return state, Report()
