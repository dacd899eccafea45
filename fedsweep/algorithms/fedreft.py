"""FedReFT+: LoReFT interventions with All-But-Me geometric-median aggregation.

Paper: "FedReFT+: Federated Representation Fine-Tuning with All-But-Me Aggregation".
Defaults follow the paper's experiments: untied interventions (``reft.tied: false``), α tuned
on the local validation loss (``alpha_tuning: loss_grid``).

Server (eq. 5, 7–8, 16): for each sampled client k and each shared parameter type
X ∈ {W, R, b} separately (all layers' tensors of that type as one vector),

    X_k^ABM = argmin_y Σ_{m≠k} ‖y − X_m‖        (geometric median of the others)

by Weiszfeld's iteration y ← Σ_m w_m X_m / Σ_m w_m, w_m = 1/‖y − X_m‖_ε (smoothed by ε
so an iterate on a data point is safe), all K medians at once as one batched iteration;
stop when the largest relative change is below ``tol`` or after ``max_iter``.
``aggregator: mean_abm`` (plain mean of the others) and ``fedavg`` (n_k-weighted mean of
all) are the paper's ablation rows.

Client (eq. 6, App. D): X_k ← (1 − α) X_k + α X_k^ABM for the shared types, α fixed or,
with ``alpha_tuning: loss_grid``, the α ∈ {0, 0.1, …, 1} of least local validation loss (all
eleven mixes of all of an actor's clients that train together scored in one pass,
``client_prepare_group``); then R is re-orthonormalised (QR) before local training. Unshared types
never leave the client.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams
from fedsweep.algorithms.tensors import Params, RowSets, weighted_mean
from fedsweep.algorithms.types import (AggregationContext, Candidate, ClientContext, ClientResult, GroupTools, PLAIN,
                                       Payload, Report, ServerState, Upload)
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch

GRID = [i / 10 for i in range(11)]
ALPHA_KEY = "alpha"


class FedReFTParams(HyperParams):
    alpha: float = Field(0.5, ge=0, le=1, description="mixing α of the ABM aggregate into the local interventions")
    alpha_tuning: Literal["fixed", "loss_grid"] = Field(
        "loss_grid", description="loss_grid (the paper's setting): α ∈ {0, 0.1, …, 1} of least local validation "
                                 "loss, needs data.val_fraction > 0; fixed: alpha")
    aggregator: Literal["geometric_median", "mean_abm", "fedavg"] = "geometric_median"
    share: list[Literal["W", "R", "b"]] = Field(default_factory=lambda: ["W", "R", "b"], min_length=1)
    max_iter: int = Field(1000, ge=1, description="Weiszfeld iterations at most")
    tol: float = Field(1e-10, gt=0, description="Weiszfeld stop: largest step below this times the points' spread")
    smoothing: float = Field(1e-12, gt=0, description="ε in ‖y − x‖_ε = sqrt(‖y − x‖² + (ε·spread)²)")


def param_type(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def orthonormalize_rows(r: torch.Tensor) -> torch.Tensor:
    """QR re-orthonormalisation of R's rows (signs fixed so that an orthonormal R is unchanged):
    :func:`retract_rows` of one."""
    return retract_rows(r.unsqueeze(0))[0]


def pairwise_distances(yy: torch.Tensor, xx: torch.Tensor, yx: torch.Tensor) -> torch.Tensor:
    """‖y_a − x_b‖ from squared norms and inner products (one BLAS product). Callers pass
    centred points, so the cancellation error is relative to the points' spread, not their norm."""
    return (yy[:, None] + xx[None, :] - 2.0 * yx).clamp_min(0.0).sqrt()


def duplicate_matrix(points: torch.Tensor, dist: torch.Tensor, scale: float) -> torch.Tensor:
    """(K, K) bool: rows of ``points`` that are equal entry by entry (diagonal True). Candidates are
    pairs whose distance from the Gram matrix is within rounding of 0; each is confirmed exactly."""
    k = points.shape[0]
    dup = torch.eye(k, dtype=torch.bool)
    cand = (dist.cpu() <= 1e-7 * max(scale, 1e-300)) & ~dup
    for i, j in torch.nonzero(torch.triu(cand, 1)).tolist():
        if torch.equal(points[i], points[j]):
            dup[i, j] = dup[j, i] = True
    return dup


def median_at_points(gram: torch.Tensor, dup: torch.Tensor | None = None,
                     dist: torch.Tensor | None = None) -> torch.Tensor:
    """(K,) index j of the data point that is client k's all-but-me median, or −1.

    With multiplicities: among the others O_k = {i ≠ k}, x_j (j ∈ O_k) minimises Σ_{i∈O_k} ‖y − x_i‖
    iff the pull of the points distinct from it is at most its multiplicity (the test here is
    strict) μ_kj = #{i ∈ O_k :
    x_i = x_j}: ‖S_kj‖ ≤ μ_kj with S_kj = Σ_{i∈O_k, x_i≠x_j} (x_i − x_j)/‖x_i − x_j‖ (the
    subgradient condition). With u_j the pull of all i, S_kj = u_j − [x_k ≠ x_j] (x_k − x_j)/‖x_k − x_j‖;
    every norm and inner product involved follows from the Gram matrix (no K²·n tensor).
    ``dup``: exact duplicate pairs (else distance 0 from the Gram matrix); ``dist``: the pairwise
    distances when the caller has them.
    """
    k = gram.shape[0]
    diag = gram.diagonal()
    d = pairwise_distances(diag, diag, gram) if dist is None else dist
    if dup is None:
        dup = d <= 0
    dup = dup.to(gram.device) | torch.eye(k, dtype=torch.bool, device=gram.device)
    d = torch.where(dup, torch.zeros_like(d), d.clamp_min(1e-300))
    w = torch.where(dup, torch.zeros_like(d), 1.0 / d)  # w_ji, zero for duplicates and the diagonal
    ws = w.sum(dim=1)
    ux = w @ gram - ws[:, None] * gram  # [j, l] = ⟨u_j, x_l⟩
    u_norm2 = (w @ gram * w).sum(1) - 2 * ws * (w * gram).sum(1) + ws ** 2 * diag
    s2 = u_norm2[:, None] - 2 * w * (ux - ux.diagonal()[:, None]) + (w * d) ** 2  # [j, k]: ‖S_kj‖²
    mult = dup.sum(dim=1, dtype=gram.dtype)[:, None] - dup.to(gram.dtype)  # [j, k]: μ_kj
    not_k = ~torch.eye(k, dtype=torch.bool, device=gram.device)
    # strict: where ‖S‖ = μ the minimisers form a segment (e.g. two points) and Weiszfeld's iterate,
    # also optimal, is kept — it is the symmetric choice (the midpoint of two points)
    ok = (s2.clamp_min(0).sqrt() < mult * (1 - 1e-9)) & not_k & (mult >= 1)
    out = torch.full((k,), -1, dtype=torch.long, device=gram.device)
    for kk in range(k):
        hits = torch.nonzero(ok[:, kk]).flatten()
        if len(hits):
            out[kk] = hits[0]
    return out


def geometric_median_abm(points: torch.Tensor, smoothing: float = 1e-12, tol: float = 1e-10,
                         max_iter: int = 1000) -> tuple[torch.Tensor, int]:
    """Row k: the geometric median of all rows of ``points`` (K, n) except row k (eq. 5, 7–8).

    Translation-invariant: the points are centred on their mean first, and both the stopping
    rule and the smoothing are relative to their spread s (RMS distance to the mean), not to
    ‖y‖ — a large common offset changes nothing. Every Weiszfeld iterate is a convex
    combination of the points, y_k = Σ_m c_km x_m, so the iteration runs on the K×K
    coefficients C with the Gram matrix G of the centred points: ⟨y_k, x_m⟩ = (C G)_km,
    ‖y_k‖² = (C G Cᵀ)_kk, and C ← rows of w / Σw, w_km = [m ≠ k] / sqrt(‖y_k − x_m‖² + (ε s)²).
    Cost: one K×K×n product for G, O(K³) per iteration, one C·X at the end. Medians on a data
    point (where Weiszfeld crawls) are found exactly by ``median_at_points``, duplicated
    uploads counted with their multiplicity. Stops when max_k ‖Δy_k‖ < ``tol``·s.
    """
    k = points.shape[0]
    if k == 1:
        return points.clone(), 0
    if k == 2:  # one other client: its point
        return points.flip(0).clone(), 0
    x64 = points.double()
    x64 = x64 - x64.mean(dim=0, keepdim=True)
    gram = x64 @ x64.T
    del x64
    diag = gram.diagonal()
    spread = float(diag.mean().clamp_min(0).sqrt())
    if spread == 0.0:  # all points equal
        return points.clone(), 0
    dist = pairwise_distances(diag, diag, gram)
    dup = duplicate_matrix(points, dist, spread)
    others = 1.0 - torch.eye(k, dtype=gram.dtype, device=gram.device)
    on_point = median_at_points(gram, dup, dist)
    free = on_point < 0
    c = others / (k - 1)  # start: the mean of the others
    eps2 = (smoothing * spread) ** 2
    it = 0
    for it in range(1, max_iter + 1):
        if not bool(free.any()):
            break
        cg = c @ gram
        yy = (cg * c).sum(dim=1)
        d = pairwise_distances(yy, diag, cg)
        w = others / torch.sqrt(d ** 2 + eps2)
        c_new = w / w.sum(dim=1, keepdim=True)
        dc = c_new - c
        change = ((dc @ gram) * dc).sum(dim=1).clamp_min(0).sqrt()
        c = torch.where(free[:, None], c_new, c)
        if float(change[free].max()) < tol * spread:
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


def mix_grid(locals_: list[Params], abms: list[Params], alphas: list[float]) -> RowSets:
    """:func:`mix` of every client (``locals_``, ``abms``) at every α of ``alphas``, as one (clients × α, P)
    array, row c·|α| + a client c's mix at α_a: (1 − α) local + α ABM on the shared tensors (local
    elsewhere), then QR on every R, all clients' and α's R of one tensor in one batched QR. Element by
    element the same float arithmetic as :func:`mix` (its coefficients are the same float32 numbers), and
    LAPACK's QR of each matrix is the one it computes alone: the rows are :func:`mix`'s bit for bit."""
    from fedsweep.algorithms.tensors import FlatLayout

    layout = FlatLayout.of_params(locals_[0])
    local = layout.rows(locals_)
    abm = layout.rows([{k: (a[k] if k in a else v) for k, v in loc.items()} for loc, a in zip(locals_, abms)])
    shared = torch.cat([torch.full((n,), key in abms[0]) for key, n in zip(layout.shapes, layout.sizes)])
    keep = torch.tensor([1 - a for a in alphas], dtype=local.dtype).view(1, -1, 1)
    take = torch.tensor(alphas, dtype=local.dtype).view(1, -1, 1)
    mixed = torch.where(shared, keep * local.unsqueeze(1) + take * abm.unsqueeze(1), local.unsqueeze(1))
    rows = mixed.reshape(-1, layout.width)
    sets = RowSets(rows, layout)
    for key in layout.shapes:
        if param_type(key) == "R":
            part = sets.part(key)
            part.copy_(retract_rows(part))
    return sets


def retract_rows(r: torch.Tensor) -> torch.Tensor:
    """QR re-orthonormalisation of the rows of each of a stack of R, (N, r, d) -> (N, r, d), in one batched
    QR (LAPACK's QR of each matrix, as it computes one alone), signs fixed so that an orthonormal R is
    unchanged."""
    q, rr = torch.linalg.qr(r.detach().double().transpose(1, 2))
    signs = torch.sign(torch.diagonal(rr, dim1=-2, dim2=-1))
    signs[signs == 0] = 1
    return (q * signs.unsqueeze(1)).transpose(1, 2).to(r.dtype)


@register
class FedReFT(Algorithm):
    name = "fedreft"
    capabilities = Capabilities(personalized=True, adapters=("reft",))
    Params = FedReFTParams
    summary = "LoReFT interventions; All-But-Me geometric-median aggregate mixed with α"

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        hp = cfg.hparams.get(cls.name)
        if hp is not None and hp.alpha_tuning == "loss_grid" and cfg.data.val_fraction <= 0:
            raise ValueError("fedreft.alpha_tuning: loss_grid tunes α on a local validation split, but "
                             "data.val_fraction is 0: set data.val_fraction (e.g. 0.2) or fedreft.alpha_tuning: fixed")

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

    def client_prepare_group(self, ctxs: list[ClientContext], payloads: list[Payload], tools: GroupTools) -> list[Params]:
        """:meth:`client_prepare` of a training group's clients at once: every α of the grid of every client
        that received an aggregate mixed as one (clients × 11, P) array (:func:`mix_grid`, the same
        arithmetic as :func:`mix` element by element and QR by QR) and scored in one pass over their
        validation rows (``tools.row_losses``); each client's α the least loss (ties: the smaller α), its
        start that mix, as alone."""
        tuned = [i for i, p in enumerate(payloads) if p.params is not None]
        if self.hp.alpha_tuning == "fixed" or not tuned or tools is None or tools.row_losses is None:
            return [self.client_prepare(ctx, p) for ctx, p in zip(ctxs, payloads)]
        grid = mix_grid([ctxs[i].local_params for i in tuned], [payloads[i].params for i in tuned], GRID)
        losses = tools.row_losses([i for i in tuned for _ in GRID], grid, ["val"] * len(grid))
        out = [mix(ctx.local_params, {}, 0.0) if p.params is None else None for ctx, p in zip(ctxs, payloads)]
        for j, i in enumerate(tuned):
            mine = losses[j * len(GRID):(j + 1) * len(GRID)]
            best = min(range(len(GRID)), key=lambda g: (mine[g], g))
            ctxs[i].state[ALPHA_KEY] = torch.tensor(GRID[best])
            out[i] = grid.layout.views(grid.rows[j * len(GRID) + best].clone())
        return out

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        shared = {k: v for k, v in params.items() if param_type(k) in self.hp.share}
        metrics = {"alpha": float(ctx.state[ALPHA_KEY])} if ALPHA_KEY in ctx.state else {}
        return Upload(params=shared, metrics=metrics)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
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
