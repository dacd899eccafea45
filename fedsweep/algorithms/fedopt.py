"""Server optimisers on the pseudo-gradient Δ = avg_k θ_k − θ_g (n_k-weighted average): the shared
core of fedadagrad, fedadam and fedyogi (Reddi et al. 2021, "Adaptive Federated Optimization"),
one module per method; fedavgm.py holds server momentum.

* FedAvgM (Hsu et al. 2019):  v ← β_s v + Δ;  θ_g ← θ_g + η_s v.
* FedAdagrad / FedAdam / FedYogi (Reddi et al. 2021, Algorithm 2):
      m ← β1 m + (1 − β1) Δ
      adagrad: v ← v + Δ²
      adam:    v ← β2 v + (1 − β2) Δ²
      yogi:    v ← v − (1 − β2) Δ² sign(v − Δ²)
      θ_g ← θ_g + η m / (√v + τ)
  with m_0 = 0 and v_0 = τ² (Reddi: v_{-1} ≥ τ²). ``bias_correction: true`` scales η by
  √(1 − β2^t) / (1 − β1^t), t the 1-based round (textbook Adam; adam and yogi only).

Defaults, and how they differ from Flower's strategies (flwr FedAdagrad/FedAdam/FedYogi):

  ===================  ======================  =====================================
  setting              here (Reddi et al.)     Flower
  ===================  ======================  =====================================
  η (server_lr)        1e-2                    0.1
  τ                    1e-3                    1e-9
  v_0                  τ² (``v0: tau_squared``)  0 (``v0: zero``)
  bias correction      off                     FedAdam only, exponent t + 1
                                               (``bias_correction: flower``)
  β1 / β2              0.9 / 0.99 (adagrad 0)  0.9 / 0.99 (adagrad β1 = 0)
  ===================  ======================  =====================================

``server_lr: 0.1, tau: 1e-9, v0: zero`` (and ``bias_correction: flower`` for fedadam)
reproduces Flower's numbers (tested against its update rules written out by hand).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams
from fedsweep.algorithms.tensors import Params, weighted_mean
from fedsweep.algorithms.types import AggregationContext, ClientResult, PLAIN, Report, ServerState
from fedsweep.lazy import torch


def pseudo_gradient(results: list[ClientResult], glob: Params, mean=weighted_mean) -> Params:
    """Δ = mean_k θ_k − θ_g (``mean``: the method's mean of the uploads, ``Algorithm.mean``)."""
    avg = mean([r.upload.params for r in results], [r.num_examples for r in results])
    return {k: avg[k] - glob[k] for k in glob}


class FedOptParams(HyperParams):
    server_lr: float = Field(1e-2, gt=0, description="server learning rate η")
    beta1: float = Field(0.9, ge=0, lt=1, description="first-moment decay β1")
    beta2: float = Field(0.99, ge=0, lt=1, description="second-moment decay β2 (adam, yogi)")
    tau: float = Field(1e-3, gt=0, description="adaptivity τ (Flower: 1e-9)")
    bias_correction: bool | Literal["flower"] = Field(
        False, description="true: textbook Adam bias correction, exponent t (adam, yogi); flower: exponent t + 1, "
                           "as Flower's FedAdam")
    v0: Literal["tau_squared", "zero"] = Field("tau_squared", description="initial second moment: τ² (Reddi et al.) "
                                                                          "or 0 (Flower)")


class FedAdagradParams(FedOptParams):
    beta1: float = Field(0.0, ge=0, lt=1, description="first-moment decay β1 (0: plain Adagrad)")


class ServerOptimizer(Algorithm):
    """m, v moments on the pseudo-gradient; ``rule`` picks the second-moment update (eq. in the module docstring)."""

    Params = FedOptParams
    capabilities = Capabilities(averages_uploads=True, partial_sums=True)
    rule = ""

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        b2 = self.hp.beta2
        if self.rule == "adagrad":
            return v + d2
        if self.rule == "adam":
            return b2 * v + (1 - b2) * d2
        return v - (1 - b2) * d2 * torch.sign(v - d2)  # yogi

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        hp = self.hp
        delta = pseudo_gradient(results, state.globals, ctx.mean)
        m = state.buffers.get("m") or {k: torch.zeros_like(t) for k, t in delta.items()}
        v0 = hp.tau ** 2 if hp.v0 == "tau_squared" else 0.0
        v = state.buffers.get("v") or {k: torch.full_like(t, v0) for k, t in delta.items()}
        m = {k: hp.beta1 * m[k] + (1 - hp.beta1) * delta[k] for k in delta}
        v = {k: self.second_moment(v[k], delta[k] ** 2) for k in delta}
        lr = hp.server_lr
        if hp.bias_correction and self.rule != "adagrad":
            t = rnd + 1 if hp.bias_correction == "flower" else rnd
            lr *= math.sqrt(1 - hp.beta2 ** t) / (1 - hp.beta1 ** t)
        state.globals = {k: state.globals[k] + lr * m[k] / (v[k].sqrt() + hp.tau) for k in delta}
        state.buffers["m"], state.buffers["v"] = m, v
        return state, Report()
