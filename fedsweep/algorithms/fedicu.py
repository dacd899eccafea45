"""FedICU (seed 004): consensus–divergence splitting + importance-aware updating.

Server, per LoRA factor (eq. 5–12). A rank component is a row of ``lora_A`` (r × in)
or a column of ``lora_B`` (out × r). For client k:

    M_k = ‖θ_k‖ per rank component (consensus),  V_k = θ_k / M_k (divergence)      (5)
    M   = M_prev + mean_k (M_k − M_prev)                                             (6)
    S   = cos(V_p, V_q) per rank-component slice;  s_k = mean_{j≠k} S_kj            (9–10)
    w   = softmax(s / τ) over clients, per slice                                    (11)
    V   = V_prev + Σ_k w_k (V_k − V_prev)                                            (12)
    θ_g = M ⊙ V

All slices of a factor are one batched computation over a (K, r, d) stack.

Client, after training from θ_g (eq. 14–18), with per-tensor z-scores:

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

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedsweep.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientResult,
    Params,
    Report,
    ServerState,
    Upload,
    weighted_mean,
)
from fedsweep.algorithms.registry import register

EPS = 1e-6
MOMENTUM = "m/"


class FedICUParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tau: float = Field(0.1, gt=0, description="softmax temperature of the divergence weights (eq. 11)")
    beta: float = Field(0.9, ge=0, lt=1, description="momentum of client updates (eq. 15); 0 disables momentum")
    splitting: bool = Field(True, description="consensus–divergence splitting on the server (else FedAvg)")
    updating: bool = Field(True, description="importance-aware sparse upload on clients (else upload all)")
    smooth_mask: bool = Field(False, description="W = min(1, G/(I+G)) instead of a binary mask (Table 4)")


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
    """(M, V): per-component L2 norm (…, r) and unit directions (…, r, d), eq. 5."""
    rows = as_slices(t, axis)
    m = rows.norm(dim=-1)
    return m, rows / m.clamp_min(EPS).unsqueeze(-1)


def divergence_weights(v: torch.Tensor, tau: float) -> torch.Tensor:
    """softmax_k(s_k / τ) per slice, s_k the mean cosine similarity to the other clients (eq. 9–11).

    ``v``: (K, r, d) directions. Returns (K, r).
    """
    k = v.shape[0]
    if k == 1:
        return torch.ones(v.shape[:2], dtype=v.dtype, device=v.device)
    unit = v / v.norm(dim=-1, keepdim=True).clamp_min(EPS)
    sim = torch.einsum("krd,jrd->rkj", unit, unit)  # (r, K, K)
    s = (sim.sum(-1) - sim.diagonal(dim1=-2, dim2=-1)) / (k - 1)  # (r, K)
    return torch.softmax(s / tau, dim=-1).transpose(0, 1)  # (K, r)


def consensus_divergence(stack: torch.Tensor, prev: torch.Tensor, axis: int, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """New global factor from client factors ``stack`` (K, …) and the previous global ``prev``."""
    m_k, v_k = split(stack.float(), axis)  # (K, r), (K, r, d)
    m_prev, v_prev = split(prev.float(), axis)
    m = m_prev + (m_k - m_prev).mean(dim=0)  # eq. 6
    w = divergence_weights(v_k, tau)  # (K, r)
    v = v_prev + (w.unsqueeze(-1) * (v_k - v_prev)).sum(dim=0)  # eq. 12
    return from_slices(m.unsqueeze(-1) * v, axis).to(stack.dtype), w


def zscore_sigmoid(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """σ((x − μ(ref)) / (σ(ref) + ε)), statistics over the whole tensor (eq. 14, 16)."""
    ref = ref.float()
    std = ref.std(unbiased=False) if ref.numel() > 1 else torch.zeros((), dtype=ref.dtype)
    return torch.sigmoid((x.float() - ref.mean()) / (std + EPS))


def importance_mask(global_t: torch.Tensor, m_new: torch.Tensor, m_prev: torch.Tensor, smooth: bool) -> torch.Tensor:
    """W of eq. 17 (or its smooth variant) for one tensor."""
    imp = zscore_sigmoid(global_t.abs(), global_t.abs())
    spec = zscore_sigmoid(m_new.abs(), m_prev.abs())
    hit = spec > imp
    if not smooth:
        return hit.to(global_t.dtype)
    return torch.where(hit, torch.clamp(spec / (imp + spec), max=1.0), torch.zeros_like(spec)).to(global_t.dtype)


@register
class FedICU(Algorithm):
    name = "fedicu"
    Params = FedICUParams
    summary = "consensus–divergence splitting on the server, importance-aware sparse upload on clients"

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
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
        for key, theta in params.items():
            g = glob[key]
            m_prev = ctx.state.get(MOMENTUM + key, torch.zeros_like(theta))
            m_new = beta * m_prev + (1 - beta) * (theta - g)  # eq. 15
            ctx.state[MOMENTUM + key] = m_new
            total += theta.numel()
            if first or not self.hp.updating:
                out[key], count = theta, theta.numel()
            else:
                w = importance_mask(g, m_new, m_prev, self.hp.smooth_mask)
                out[key], count = w * (g + m_new) + (1 - w) * g, int((w != 0).sum())  # eq. 18
            sent += count
            nbytes += count * theta.element_size()
        return Upload(params=out, nbytes=nbytes, metrics={"upload_fraction": sent / max(total, 1)})
