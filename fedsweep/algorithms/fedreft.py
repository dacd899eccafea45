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


def pairwise_distances(yy: torch.Tensor, xx: torch.Tensor, yx: torch.Tensor) -> torch.Tensor:
    """‖y_a − x_b‖ from squared norms and inner products (one BLAS product; float64 keeps the
    cancellation error near 1e-7 relative to the norms, well inside Weiszfeld's smoothing use)."""
    return (yy[:, None] + xx[None, :] - 2.0 * yx).clamp_min(0.0).sqrt()


def median_at_points(gram: torch.Tensor) -> torch.Tensor:
    """(K,) index j of the data point that is client k's all-but-me median, or −1.

    x_j minimises Σ_{i≠k} ‖y − x_i‖ iff the pull of the remaining points on it is below
    its own weight: ‖Σ_{i∉{j,k}} (x_i − x_j)/‖x_i − x_j‖‖ < 1. With u_j the pull of all
    i ≠ j, removing client k gives S_kj = u_j − w_jk (x_k − x_j); every norm and inner
    product involved follows from the Gram matrix (no K²·n tensor).
    """
    k = gram.shape[0]
    diag = gram.diagonal()
    d = pairwise_distances(diag, diag, gram)
    d.fill_diagonal_(0.0)
    w = torch.where(d > 0, 1.0 / d.clamp_min(1e-300), torch.zeros_like(d))  # w_ji, zero on the diagonal
    ws = w.sum(dim=1)
    ux = w @ gram - ws[:, None] * gram  # [j, l] = ⟨u_j, x_l⟩
    u_norm2 = (w @ gram * w).sum(1) - 2 * ws * (w * gram).sum(1) + ws ** 2 * diag
    s2 = u_norm2[:, None] - 2 * w * (ux - ux.diagonal()[:, None]) + (w * d) ** 2  # [j, k]: ‖S_kj‖²
    ok = (s2 < 1.0 - 1e-9) & (d > 0) & ~torch.eye(k, dtype=torch.bool, device=gram.device)
    out = torch.full((k,), -1, dtype=torch.long, device=gram.device)
    for kk in range(k):
        hits = torch.nonzero(ok[:, kk]).flatten()
        if len(hits):
            out[kk] = hits[0]
    return out


def geometric_median_abm(points: torch.Tensor, smoothing: float = 1e-8, tol: float = 1e-6,
                         max_iter: int = 100) -> tuple[torch.Tensor, int]:
    """Row k: the geometric median of all rows of ``points`` (K, n) except row k.

    Every Weiszfeld iterate is a convex combination of the points, y_k = Σ_m c_km x_m, so the
    iteration runs on the K×K coefficients C with the Gram matrix G = X Xᵀ:
    ⟨y_k, x_m⟩ = (C G)_km, ‖y_k‖² = (C G Cᵀ)_kk, and C ← rows of w / Σw,
    w_km = [m ≠ k] / ‖y_k − x_m‖_ε. Cost: one K×K×n product for G, O(K³) per iteration,
    one C·X at the end. Medians on a data point (where Weiszfeld crawls) are found exactly
    by ``median_at_points``. Stops when the largest relative change ‖Δy_k‖/‖y_k‖ < ``tol``.
    """
    k = points.shape[0]
    if k == 1:
        return points.clone(), 0
    if k == 2:  # one other client: its point
        return points.flip(0).clone(), 0
    x64 = points.double()
    gram = x64 @ x64.T
    del x64
    diag = gram.diagonal()
    others = 1.0 - torch.eye(k, dtype=gram.dtype, device=gram.device)
    on_point = median_at_points(gram)
    free = on_point < 0
    c = others / (k - 1)  # start: the mean of the others
    it = 0
    for it in range(1, max_iter + 1):
        if not bool(free.any()):
            break
        cg = c @ gram
        yy = (cg * c).sum(dim=1)
        dist = pairwise_distances(yy, diag, cg)
        w = others / torch.sqrt(dist ** 2 + smoothing ** 2)
        c_new = w / w.sum(dim=1, keepdim=True)
        dc = c_new - c
        change = ((dc @ gram) * dc).sum(dim=1).clamp_min(0).sqrt() / yy.clamp_min(1e-300).sqrt()
        c = torch.where(free[:, None], c_new, c)
        if float(change[free].max()) < tol:
            break
    snapped = on_point >= 0
    c[snapped] = torch.nn.functional.one_hot(on_point[snapped], k).to(c.dtype)
    return (c.to(points.dtype) @ points), it


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
                    personal[i][k] = piece.reshape(results[0].upload.params[k].shape)
        for i, r in enumerate(results):
            state.personal[r.cid] = personal[i]
        return state, Report(metrics={"weiszfeld_iterations": float(max(iters))} if iters else {})
