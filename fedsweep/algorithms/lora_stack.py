"""Exact LoRA products without dense cross terms, shared by FLoRA and FlexLoRA.

Client k's update of a module is s_k B_k A_k (s_k = α/r_k). Stacking the factors,
[p_1 s_1 B_1 | … | p_K s_K B_K] · [A_1; …; A_K] = Σ_k p_k s_k B_k A_k exactly, for any
mix of ranks.
"""

from __future__ import annotations

from fedsweep.algorithms.types import ClientInfo, ClientResult
from fedsweep.lazy import torch

A, B = ".lora_A.weight", ".lora_B.weight"


def client_meta(clients: list[ClientInfo]) -> dict:
    """JSON server meta with each client's rank and LoRA scale α/r (keys are client ids as strings)."""
    return {"ranks": {str(c.cid): c.rank for c in clients}, "scales": {str(c.cid): c.lora_scale for c in clients}}


def scales(meta: dict) -> dict[int, float]:
    return {int(c): s for c, s in meta["scales"].items()}


def modules(params) -> list[str]:
    return sorted(k[: -len(A)] for k in params if k.endswith(A))


def stacked_factors(results: list[ClientResult], scales: dict[int, float]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per module (B_stack, A_stack) with B_stack A_stack = Σ_k p_k s_k B_k A_k, p_k = n_k / Σ n."""
    total = float(sum(r.num_examples for r in results))
    out = {}
    for m in modules(results[0].upload.params):
        bs = [r.upload.params[m + B].float() * (r.num_examples / total * scales[r.cid]) for r in results]
        as_ = [r.upload.params[m + A].float() for r in results]
        out[m] = (torch.cat(bs, dim=1), torch.cat(as_, dim=0))
    return out


def truncated_factors(b_stack: torch.Tensor, a_stack: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``rank`` factors (B', A') with scale·B'A' = the best rank-``rank`` approximation of b_stack·a_stack.

    Exact truncated SVD through QR of the thin factors: B_s = Q_b R_b, A_sᵀ = Q_a R_a,
    B_s A_s = Q_b (R_b R_aᵀ) Q_aᵀ and the small core's SVD gives the singular triplets.
    Cost O(d·R²) instead of a dense d_out × d_in SVD. Missing components are zero.
    """
    qb, rb = torch.linalg.qr(b_stack.double())
    qa, ra = torch.linalg.qr(a_stack.double().T)
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    k = min(rank, s.numel())
    root = s[:k].sqrt() / (scale ** 0.5)
    b_new = torch.zeros(b_stack.shape[0], rank, dtype=torch.float64)
    a_new = torch.zeros(rank, a_stack.shape[1], dtype=torch.float64)
    b_new[:, :k] = (qb @ u[:, :k]) * root
    a_new[:k] = root[:, None] * (vh[:k] @ qa.T)
    return b_new.to(b_stack.dtype), a_new.to(a_stack.dtype)
