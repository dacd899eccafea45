"""FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2): server Adagrad on the
pseudo-gradient Δ = avg_k θ_k − θ_g. The update rule and its defaults are in ``fedopt.py``."""

from __future__ import annotations

from fedsweep.algorithms.fedopt import FedAdagradParams, ServerOptimizer
from fedsweep.algorithms.registry import register


@register
class FedAdagrad(ServerOptimizer):
    name = "fedadagrad"
    rule = "adagrad"
    Params = FedAdagradParams
    summary = "server Adagrad on the pseudo-gradient (Reddi et al. 2021)"
