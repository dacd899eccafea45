"""FedICU: consensus–divergence splitting + importance-aware updating.

Paper: "FedICU: Splitting with Importance-aware Updating for Heterogeneous Federated
Learning with Large Language Models".

Server, per LoRA factor (eq. 5–12). A rank component is a row of ``lora_A`` (r × in)
or a column of ``lora_B`` (out × r). For client k:

    M_k = ‖θ_k‖ per rank component (consensus),  V_k = θ_k / M_k (divergence)      (5)
          (a unit vector; a component of norm exactly 0 has no direction: it is left out
          of eq. 9–12 for that slice, the others' weights renormalised; if no client has a
          direction, V keeps the previous global's — never a division by a floor)
    M   = M_prev + mean_k (M_k − M_prev)                                             (6)
    S   = cos(V_p, V_q) per rank-component slice;  s_k = mean_{j≠k} S_kj            (9–10)
    w   = softmax(s / τ) over clients, per slice                                    (11)
    V   = V_prev + Σ_k w_k (V_k − V_prev)                                            (12)
    θ_g = M ⊙ V

All slices of a factor are one batched computation over a (K, r, d) stack.

Client, after training from θ_g (eq. 14–18). The z-scores' μ and σ are taken over the
whole parameter vector θ ∈ ℝ^d (Appendix I, ``zscore: model``, the default) or over each
tensor separately (``zscore: tensor``):

    m_k ← β m_k + (1 − β)(θ_k − θ_g)                                                (15)
    I   = σ(z(|θ_g|))                                                                (14)
    G   = σ((|m_k| − μ(|m_k^prev|)) / (σ(|m_k^prev|) + 1e-6))                        (16)
    W   = 1[G > I]       (smooth_mask: W = min(1, G/(I+G)) where G > I, else 0)       (17)
    upload W ⊙ (θ_g + m_k) + (1 − W) ⊙ θ_g                                           (18)

On a client's first participation it uploads its trained parameters θ_k whole ("in the
first iteration, all local model parameters are uploaded"). Only masked entries count
as uploaded bytes (the server rebuilds the dense tensor from θ_g, which it holds).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedsweep.algorithms.base import Algorithm, HyperParams
from fedsweep.algorithms.tensors import FlatLayout, Params, weighted_mean
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientResult, PLAIN, Report, ServerState,
                                       Upload)
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch

EPS = 1e-6
MOMENTUM = "m/"


class FedICUParams(HyperParams):
    tau: float = Field(0.1, gt=0, description="softmax temperature of the divergence weights (eq. 11)")
    beta: float = Field(0.9, ge=0, lt=1, description="momentum of client updates (eq. 15); 0 disables momentum")
    splitting: bool = Field(True, description="consensus–divergence splitting on the server (else FedAvg)")
    updating: bool = Field(True, description="importance-aware sparse upload on clients (else upload all)")
    smooth_mask: bool = Field(False, description="W = min(1, G/(I+G)) instead of a binary mask (Table 4)")
    zscore: Literal["model", "tensor"] = Field(
        "model", description="statistics of the z-scores in I and G: over the whole parameter vector (Appendix I) "
                             "or per tensor")


def rank_axis(key: str) -> int | None:
    """The axis of the rank components of a LoRA factor: rows of A (0), columns of B (1)."""
    if "lora_A" in key:
        return 0
    if "lora_B" in key:
        return 1
    return None


def as_slices(t: torch.Tensor, axis: int) -> torch.Tensor:
    """(..., r, d): the rank components of a factor as rows."""
    return t if axis == 0 else t.transpose(-1, -2)


def from_slices(t: torch.Tensor, axis: int) -> torch.Tensor:
    return t if axis == 0 else t.transpose(-1, -2)


def split(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, V): per-component L2 norm (…, r) and unit directions (…, r, d), eq. 5, in float64.

    A component of norm exactly 0 gets direction 0 (it has none; callers treat it as missing).
    """
    rows = as_slices(t, axis).double()
    m = rows.norm(dim=-1)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    return m, rows / safe.unsqueeze(-1)


def divergence_weights(v: torch.Tensor, tau: float, defined: torch.Tensor | None = None) -> torch.Tensor:
    """softmax_k(s_k / τ) per slice, s_k the mean cosine similarity to the other clients (eq. 9–11).

    ``v``: (K, r, d) unit directions; ``defined``: (K, r) bool, False where a client's component
    has no direction (norm 0): it gets weight 0 and is left out of the others' means. Returns
    (K, r); a slice where no client has a direction gets all-zero weights.
    """
    if defined is None:
        defined = torch.ones(v.shape[:2], dtype=torch.bool, device=v.device)
    dm = defined.to(v.dtype)
    sim = torch.einsum("krd,jrd->rkj", v, v)  # (r, K, K); rows of undefined clients are 0
    n_other = (dm.sum(0)[:, None] - dm.T).clamp_min(1)  # (r, K): defined others
    s = (sim.sum(-1) - sim.diagonal(dim1=-2, dim2=-1)) / n_other  # (r, K)
    logits = torch.where(defined.T, s / tau, torch.full_like(s, -torch.inf))
    w = torch.softmax(logits, dim=-1)
    w = torch.nan_to_num(w, nan=0.0)  # slices with no defined client
    return w.transpose(0, 1)  # (K, r)


def consensus_divergence(stack: torch.Tensor, prev: torch.Tensor, axis: int, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """New global factor from client factors ``stack`` (K, …) and the previous global ``prev``.

    Computed in float64. Since the weights of eq. 11 sum to 1 over the clients with a direction,
    eq. 12 is V = Σ_k w_k V_k and eq. 6 is M = mean_k M_k; V_prev matters only for a slice where
    no client has a direction.
    """
    m_k, v_k = split(stack, axis)  # (K, r), (K, r, d)
    m_prev, v_prev = split(prev, axis)
    defined = m_k > 0
    m = m_prev + (m_k - m_prev).mean(dim=0)  # eq. 6
    w = divergence_weights(v_k, tau, defined)  # (K, r)
    v = v_prev + (w.unsqueeze(-1) * (v_k - v_prev)).sum(dim=0)  # eq. 12
    none = ~defined.any(dim=0)  # (r,) no client has a direction: keep the previous one
    v = torch.where(none[:, None], v_prev, v)
    return from_slices(m.unsqueeze(-1) * v, axis).to(stack.dtype), w


def _stats(ref: torch.Tensor | list[torch.Tensor]) -> tuple[float, float]:
    """Population mean and standard deviation, in float64, of one tensor or of several together."""
    parts = [ref] if isinstance(ref, torch.Tensor) else ref
    n = sum(p.numel() for p in parts)
    if n == 0:
        return 0.0, 0.0
    mean = sum(float(p.double().sum()) for p in parts) / n
    var = sum(float((p.double() - mean).square().sum()) for p in parts) / n
    return mean, var ** 0.5


def zscore_sigmoid(x: torch.Tensor, ref: torch.Tensor | list[torch.Tensor],
                   stats: tuple[float, float] | None = None) -> torch.Tensor:
    """σ((x − μ(ref)) / (σ(ref) + ε)) (eq. 14, 16); ``ref`` one tensor or the whole parameter vector
    as a list of tensors; ``stats`` = (μ, σ) when already computed."""
    mu, sd = stats if stats is not None else _stats(ref)
    return torch.sigmoid((x.double() - mu) / (sd + EPS)).to(torch.float32)


def importance_mask(global_t: torch.Tensor, m_new: torch.Tensor, m_prev: torch.Tensor, smooth: bool,
                    imp_stats: tuple[float, float] | None = None,
                    spec_stats: tuple[float, float] | None = None) -> torch.Tensor:
    """W of eq. 17 (or its smooth variant) for one tensor; statistics from that tensor unless
    given (``zscore: model`` passes those of the whole parameter vector)."""
    imp = zscore_sigmoid(global_t.abs(), global_t.abs(), imp_stats)
    spec = zscore_sigmoid(m_new.abs(), m_prev.abs(), spec_stats)
    hit = spec > imp
    if not smooth:
        return hit.to(global_t.dtype)
    return torch.where(hit, torch.clamp(spec / (imp + spec), max=1.0), torch.zeros_like(spec)).to(global_t.dtype)


def _group_masks(layout, g: torch.Tensor, m_new: torch.Tensor, m_prev: torch.Tensor, smooth: bool,
                 zscore: str) -> torch.Tensor:
    """W of eq. 17 for every client of a group at once ((K, P), ``g`` (P,)): :func:`importance_mask` of each
    client and tensor, each statistic computed as there (each tensor's float64 sums, per client)."""
    spans = [(layout.offsets[key], layout.offsets[key] + n) for key, n in zip(layout.shapes, layout.sizes)]

    def stats(ref: torch.Tensor) -> list[tuple[float, float]] | tuple[torch.Tensor, torch.Tensor]:
        """(μ, σ) of ``ref`` (K, P) per client over the whole vector (as ``_stats`` of its tensors), as
        (K, 1) columns; per tensor (``zscore: tensor``), as (K, P) spreads of each tensor's."""
        ref = ref.double()
        sums = torch.stack([ref[:, a:b].sum(dim=1) for a, b in spans]).T.tolist()  # (K, tensors)
        if zscore == "model":
            n = layout.width
            means = [sum(row) / n for row in sums]
            mu = torch.tensor(means, dtype=torch.float64).unsqueeze(1)
            sq = torch.stack([(ref[:, a:b] - mu).square().sum(dim=1) for a, b in spans]).T.tolist()
            sd = [(sum(row) / n) ** 0.5 for row in sq]
            return mu, torch.tensor(sd, dtype=torch.float64).unsqueeze(1)
        mus = [[s / (b - a) for s, (a, b) in zip(row, spans)] for row in sums]
        mu_cols = torch.tensor(mus, dtype=torch.float64)
        sq = torch.stack([(ref[:, a:b] - mu_cols[:, j:j + 1]).square().sum(dim=1) for j, (a, b) in enumerate(spans)]).T.tolist()
        sds = [[(q / (b - a)) ** 0.5 for q, (a, b) in zip(row, spans)] for row in sq]
        sizes = torch.tensor([b - a for a, b in spans])
        return (mu_cols.repeat_interleave(sizes, dim=1), torch.tensor(sds, dtype=torch.float64).repeat_interleave(sizes, dim=1))

    def sigmoid(x: torch.Tensor, mu: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid((x.double() - mu) / (sd + EPS)).to(torch.float32)

    gk = g.unsqueeze(0)
    imp = sigmoid(gk.abs(), *stats(gk.abs()))  # (1, P): θ_g is every client's
    spec = sigmoid(m_new.abs(), *stats(m_prev.abs()))
    hit = spec > imp
    if not smooth:
        return hit.to(g.dtype)
    return torch.where(hit, torch.clamp(spec / (imp + spec), max=1.0), torch.zeros_like(spec)).to(g.dtype)


@register
class FedICU(Algorithm):
    name = "fedicu"
    Params = FedICUParams
    summary = "consensus–divergence splitting on the server, importance-aware sparse upload on clients"

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        uploads = [r.upload.params for r in results]
        if not self.hp.splitting:
            state.globals = weighted_mean(uploads, [r.num_examples for r in results])
            return state, Report()
        new: Params = {}
        spread = []
        for key, prev in state.globals.items():
            stack = torch.stack([u[key] for u in uploads])
            axis = rank_axis(key)
            if axis is None:  # not a LoRA factor: plain mean
                new[key] = stack.float().mean(0).to(prev.dtype)
                continue
            new[key], w = consensus_divergence(stack, prev, axis, self.hp.tau)
            spread.append(float(w.max(dim=0).values.mean()))
        state.globals = new
        metrics = {"divergence_weight_max_mean": sum(spread) / len(spread)} if spread else {}
        return state, Report(metrics=metrics)

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        glob = ctx.payload.params
        first = not any(k.startswith(MOMENTUM) for k in ctx.state)
        beta = self.hp.beta
        out: Params = {}
        sent = total = nbytes = 0
        m_prevs = {key: ctx.state.get(MOMENTUM + key, torch.zeros_like(theta)) for key, theta in params.items()}
        imp_stats = spec_stats = None
        masking = not first and self.hp.updating
        if masking and self.hp.zscore == "model":  # μ, σ over the whole parameter vector θ ∈ ℝ^d (Appendix I)
            imp_stats = _stats([glob[key].abs() for key in params])
            spec_stats = _stats([m.abs() for m in m_prevs.values()])
        for key, theta in params.items():
            g = glob[key]
            m_prev = m_prevs[key]
            m_new = beta * m_prev + (1 - beta) * (theta - g)  # eq. 15
            ctx.state[MOMENTUM + key] = m_new
            total += theta.numel()
            if not masking:
                out[key], count = theta, theta.numel()
            else:
                w = importance_mask(g, m_new, m_prev, self.hp.smooth_mask, imp_stats, spec_stats)
                out[key], count = w * (g + m_new) + (1 - w) * g, int((w != 0).sum())  # eq. 18
            sent += count
            nbytes += count * theta.element_size()
        return Upload(params=out, nbytes=nbytes, sent_share=sent / max(total, 1),
                      metrics={"upload_fraction": sent / max(total, 1)})

    def client_upload_group(self, ctxs: list[ClientContext], params: list[Params], tools) -> list[Upload]:
        """:meth:`client_upload` of a training group's clients at once (their θ_g is one), eq. 14–18 over
        their parameters as one (K, P) array: the same arithmetic element by element, every client's
        statistics its own (each tensor's float64 sum, then their sum in the same order), the same
        uploads bit for bit."""
        glob = ctxs[0].payload.params
        if any(c.payload.params is not glob for c in ctxs) or len({tuple(p) for p in params}) > 1:
            return [self.client_upload(ctx, p) for ctx, p in zip(ctxs, params)]
        layout = FlatLayout.of_params(params[0])
        keys, beta, k = list(layout.shapes), self.hp.beta, len(ctxs)
        theta = layout.rows(params)
        g = layout.rows([glob])[0]
        first = [not any(key.startswith(MOMENTUM) for key in c.state) for c in ctxs]
        m_prev = layout.rows([{key: c.state.get(MOMENTUM + key, torch.zeros_like(params[0][key])) for key in keys}
                              for c in ctxs])
        m_new = beta * m_prev + (1 - beta) * (theta - g)  # eq. 15
        masking = [not f and self.hp.updating for f in first]
        out = theta.clone()
        if any(masking):
            w = _group_masks(layout, g, m_new, m_prev, self.hp.smooth_mask, self.hp.zscore)
            masked = w * (g + m_new) + (1 - w) * g  # eq. 18
            which = torch.tensor(masking).unsqueeze(1)
            out = torch.where(which, masked, theta)
            counts = torch.where(which.squeeze(1), (w != 0).sum(dim=1), torch.full((k,), layout.width)).tolist()
        else:
            counts = [layout.width] * k
        size = theta.element_size()
        uploads = []
        for i, ctx in enumerate(ctxs):  # (each client's rows in storages of their own: none keeps another's alive)
            for key, view in layout.views(m_new[i].clone()).items():
                ctx.state[MOMENTUM + key] = view
            share = counts[i] / max(layout.width, 1)
            uploads.append(Upload(params=layout.views(out[i].clone()), nbytes=int(counts[i]) * size, sent_share=share,
                                  metrics={"upload_fraction": share}))
        return uploads
