"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2): server Adam on the
pseudo-gradient Δ = avg_k θ_k − θ_g. The update rule and its defaults are in ``fedopt.py``."""

from __future__ import annotations

from fedsweep.algorithms.fedopt import ServerOptimizer
from fedsweep.algorithms.registry import register


@register
class FedAdam(ServerOptimizer):
    name = "fedadam"
    rule = "adam"
    summary = "server Adam on the pseudo-gradient (Reddi et al. 2021)"
