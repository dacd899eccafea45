"""FedReFT+ (seed 001): LoReFT interventions with All-But-Me geometric-median aggregation.

Server (eq. 5, 7–8, 16): for each sampled client k and each shared parameter type
X ∈ {W, R, b} separately (all layers' tensors of that type as one vector),

    X_k^ABM = argmin_y Σ_{m≠k} ‖y − X_m‖        (geometric median of the others)

by Weiszfeld's iteration y ← Σ_m w_m X_m / Σ_m w_m, w_m = 1/‖y − X_m‖_ε (smoothed by ε
so an iterate on a data point is safe), all K medians at once as one batched iteration;
stop when the largest relative change is below ``tol`` or after ``max_iter``.
``aggregator: mean_abm`` (plain mean of the others) and ``fedavg`` (n_k-weighted mean of
all) are the paper's ablation rows.

Client (eq. 6, App. D): X_k ← (1 − α) X_k + α X_k^ABM for the shared types, α fixed or,
with ``alpha_tuning: loss_grid``, the α ∈ {0, 0.1, …, 1} of least local validation loss;
then R is re-orthonormalised (QR) before local training. Unshared types never leave the
client.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedsweep.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientResult,
    Params,
    Payload,
    Report,
    ServerState,
    Upload,
    weighted_mean,
)
from fedsweep.algorithms.registry import register

GRID = [i / 10 for i in range(11)]
ALPHA_KEY = "alpha"


class FedReFTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(0.5, ge=0, le=1, description="mixing α of the ABM aggregate into the local interventions")
    alpha_tuning: Literal["fixed", "loss_grid"] = Field("fixed", description="loss_grid: α by local validation loss")
    aggregator: Literal["geometric_median", "mean_abm", "fedavg"] = "geometric_median"
    share: list[Literal["W", "R", "b"]] = Field(default_factory=lambda: ["W", "R", "b"], min_length=1)
    max_iter: int = Field(100, ge=1, description="Weiszfeld iterations at most")
    tol: float = Field(1e-6, gt=0, description="Weiszfeld stop: relative change below this")
    smoothing: float = Field(1e-8, gt=0, description="ε in ‖y − x‖_ε = sqrt(‖y − x‖² + ε²)")


def param_type(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def orthonormalize_rows(r: torch.Tensor) -> torch.Tensor:
    """QR re-orthonormalisation of R's rows (signs fixed so that an orthonormal R is unchanged)."""
    q, rr = torch.linalg.qr(r.detach().double().T)
    signs = torch.sign(torch.diagonal(rr))
    signs[signs == 0] = 1
    return (q * signs).T.to(r.dtype)


def median_at_points(x: torch.Tensor) -> torch.Tensor:
    """(K,) index j of the data point that is client k's all-but-me median, or −1.

    x_j minimises Σ_{i≠k} ‖y − x_i‖ iff the pull of the remaining points on it is at most
    its own weight: ‖Σ_{i∉{j,k}} (x_i − x_j)/‖x_i − x_j‖‖ ≤ 1. With u_j the pull of all
    i ≠ j, removing client k gives S_kj = u_j − w_jk (x_k − x_j), whose norm follows from
    K×K dot products (no K²·n tensor).
    """
    k = x.shape[0]
    d = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
    w = torch.where(d > 0, 1.0 / d.clamp_min(1e-300), torch.zeros_like(d))  # w_ji, zero on the diagonal
    u = w @ x - w.sum(dim=1, keepdim=True) * x  # u_j = Σ_{i≠j} w_ji (x_i − x_j)
    ux = u @ x.T  # ⟨u_j, x_k⟩
    u_norm2 = (u * u).sum(dim=1)
    s2 = u_norm2[:, None] - 2 * w * (ux - ux.diagonal()[:, None]) + (w * d) ** 2  # [j, k]: ‖S_kj‖²
    ok = (s2 < 1.0 - 1e-9) & (d > 0) & ~torch.eye(k, dtype=torch.bool, device=x.device)
    out = torch.full((k,), -1, dtype=torch.long, device=x.device)
    for kk in range(k):
        hits = torch.nonzero(ok[:, kk]).flatten()
        if len(hits):
            out[kk] = hits[0]
    return out


def geometric_median_abm(points: torch.Tensor, smoothing: float = 1e-8, tol: float = 1e-6,
                         max_iter: int = 100) -> tuple[torch.Tensor, int]:
    """Row k: the geometric median of all rows of ``points`` (K, n) except row k.

    Medians that sit on a data point (where Weiszfeld converges sublinearly) are found
    exactly by ``median_at_points``; the others by one batched Weiszfeld iteration.
    """
    x = points.double()
    k = x.shape[0]
    if k == 1:
        return points.clone(), 0
    if k == 2:  # one other client: its point
        return points.flip(0).clone(), 0
    others = 1.0 - torch.eye(k, dtype=x.dtype, device=x.device)
    on_point = median_at_points(x)
    y = others @ x / (k - 1)  # start: the mean of the others
    free = on_point < 0
    it = 0
    for it in range(1, max_iter + 1):
        if not bool(free.any()):
            break
        dist = torch.cdist(y, x, compute_mode="donot_use_mm_for_euclid_dist")
        w = others / torch.sqrt(dist ** 2 + smoothing ** 2)
        y_new = (w @ x) / w.sum(dim=1, keepdim=True)
        change = (y_new - y).norm(dim=1) / y.norm(dim=1).clamp_min(1e-12)
        y = torch.where(free[:, None], y_new, y)
        if float(change[free].max()) < tol:
            break
    snapped = on_point >= 0
    y[snapped] = x[on_point[snapped]]
    return y.to(points.dtype), it


def mean_abm(points: torch.Tensor) -> torch.Tensor:
    k = points.shape[0]
    if k == 1:
        return points.clone()
    return (points.sum(dim=0, keepdim=True) - points) / (k - 1)


def mix(local: Params, abm: Params, alpha: float) -> Params:
    """(1 − α) local + α ABM on the shared tensors, local elsewhere, then QR on every R."""
    out = {}
    for k, v in local.items():
        out[k] = (1 - alpha) * v + alpha * abm[k] if k in abm else v.clone()
        if param_type(k) == "R":
            out[k] = orthonormalize_rows(out[k])
    return out


@register
class FedReFT(Algorithm):
    name = "fedreft"
    personalized = True
    adapters = ("reft",)
    Params = FedReFTParams
    summary = "LoReFT interventions; All-But-Me geometric-median aggregate mixed with α"

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        return {cid: Payload(params=state.personal.get(cid)) for cid in sampled}

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return Payload()  # each client is evaluated with its own (personalised, trained) interventions

    def client_prepare(self, ctx: ClientContext, payload: Payload) -> Params:
        local = ctx.local_params
        if payload.params is None:  # nothing aggregated yet
            return mix(local, {}, 0.0)
        if self.hp.alpha_tuning == "fixed":
            alpha = self.hp.alpha
        else:
            losses = [ctx.eval_loss(mix(local, payload.params, a), "val") for a in GRID]
            alpha = GRID[min(range(len(GRID)), key=lambda i: (losses[i], i))]
        ctx.state[ALPHA_KEY] = torch.tensor(alpha)
        return mix(local, payload.params, alpha)

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        shared = {k: v for k, v in params.items() if param_type(k) in self.hp.share}
        metrics = {"alpha": float(ctx.state[ALPHA_KEY])} if ALPHA_KEY in ctx.state else {}
        return Upload(params=shared, metrics=metrics)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
        keys = sorted(results[0].upload.params)
        personal: list[Params] = [{} for _ in results]
        iters = []
        for ptype in sorted({param_type(k) for k in keys}):
            group = [k for k in keys if param_type(k) == ptype]
            sizes = [results[0].upload.params[k].numel() for k in group]
            flat = torch.stack([torch.cat([r.upload.params[k].reshape(-1) for k in group]) for r in results])
            if self.hp.aggregator == "geometric_median":
                agg, n_iter = geometric_median_abm(flat, self.hp.smoothing, self.hp.tol, self.hp.max_iter)
                iters.append(n_iter)
            elif self.hp.aggregator == "mean_abm":
                agg = mean_abm(flat)
            else:
                mean = weighted_mean([{"x": row} for row in flat], [r.num_examples for r in results])["x"]
                agg = mean.unsqueeze(0).expand_as(flat)
            for i in range(len(results)):
                for k, piece in zip(group, torch.split(agg[i], sizes)):
                    personal[i][k] = piece.reshape(results[0].upload.params[k].shape).clone()
        for i, r in enumerate(results):
            state.personal[r.cid] = personal[i]
        return state, Report(metrics={"weiszfeld_iterations": float(max(iters))} if iters else {})
