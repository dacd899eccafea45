"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks"): FedAvg on the server, a proximal term on the client."""

from __future__ import annotations

from pydantic import Field

from fedsweep.algorithms.base import HyperParams
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import ClientContext
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch


class FedProxParams(HyperParams):
    mu: float = Field(0.01, ge=0, description="weight μ of the proximal term μ/2 ‖θ − θ_g‖²")


def proximal_term(params: Params, anchor: Params, mu: float) -> torch.Tensor:
    """μ/2 Σ ‖θ − θ_g‖² over the trainable tensors (gradient μ(θ − θ_g))."""
    total = sum(((p - anchor[k].detach().to(p.device, p.dtype)) ** 2).sum() for k, p in params.items())
    return 0.5 * mu * total


@register
class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams
    summary = "FedAvg with a proximal term μ/2‖θ − θ_g‖² in the local loss"

    def client_loss(self, ctx: ClientContext, loss: torch.Tensor, params: Params) -> torch.Tensor:
        if self.hp.mu == 0 or ctx.payload.params is None:
            return loss
        return loss + proximal_term(params, ctx.payload.params, self.hp.mu)
