"""DRIFT's graph side (seed 000, §4): divergences, MST neighbours, δ-selected shortest paths, weights.

Pure functions on tensors and networkx graphs; ``drift.py`` wires them into a plugin.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch

DIV_EPS = 1e-12


def symmetric_kl_matrix(stacked: torch.Tensor) -> torch.Tensor:
    """All K×K symmetric KL divergences between softmax(vec(θ_k)) rows (eq. 6–8).

    ``stacked``: (K, n), one flattened tensor per client. With p_s = softmax(x_s) and
    log p_s = x_s − lse_s, KL(s‖t) = p_s·x_s − p_s·x_t + lse_t − lse_s, so the log-partition
    terms cancel in the symmetric sum:

        SKL(s, t) = p_s·x_s − p_s·x_t + p_t·x_t − p_t·x_s = C_ss − C_st + C_tt − C_ts,  C = P Xᵀ.

    One exp pass and one (K×n)·(n×K) product per tensor; no logarithm of n-vectors.
    """
    x = stacked.float()
    e = (x - x.amax(dim=1, keepdim=True)).exp_()
    c = (e @ x.T).div_(e.sum(dim=1)[:, None])  # c[s, t] = p_s · x_t
    diag = c.diagonal()
    skl = diag[:, None] + diag[None, :] - c - c.T
    return (0.5 * (skl + skl.T)).clamp_min(0.0).to(torch.float64)  # exactly symmetric


def divergence_matrix(uploads: list[dict[str, torch.Tensor]], eps: float) -> torch.Tensor:
    """d_{s,t} = Σ over adapter tensors of SKL (eq. 6–7); off-diagonal entries clamped at ``eps``."""
    keys = sorted(uploads[0])
    k = len(uploads)
    total = torch.zeros((k, k), dtype=torch.float64, device=uploads[0][keys[0]].device)
    for key in keys:
        total += symmetric_kl_matrix(torch.stack([u[key].reshape(-1) for u in uploads]))
    total = total.cpu()
    off = ~torch.eye(k, dtype=torch.bool)
    total[off] = total[off].clamp_min(eps)
    total.fill_diagonal_(0.0)
    return total


def client_graph(d: torch.Tensor) -> nx.Graph:
    """Complete undirected graph on the clients (0..K-1), edge weight d_{s,t}."""
    g = nx.Graph()
    k = d.shape[0]
    g.add_nodes_from(range(k))
    g.add_weighted_edges_from((s, t, float(d[s, t])) for s in range(k) for t in range(s + 1, k))
    return g


@dataclass
class Selection:
    """Who client ``source`` aggregates with, and the edge that brings each one in."""

    source: int
    neighbours: list[int]
    entering_edge: dict[int, float]  # neighbour -> divergence of the edge that brings it in
    path: list[int] | None = None  # SP: the chosen path, source first


def mst_selection(g: nx.Graph) -> list[Selection]:
    """Kruskal MST (eq. 10); each client aggregates with its immediate MST neighbours."""
    tree = nx.minimum_spanning_tree(g, weight="weight", algorithm="kruskal")
    out = []
    for k in sorted(g.nodes):
        nbrs = sorted(tree.neighbors(k))
        out.append(Selection(k, nbrs, {j: tree[k][j]["weight"] for j in nbrs}))
    return out


def choose_path(paths: dict[int, list[int]], cost: dict[int, float], delta: float) -> int:
    """The δ rule (eq. 12–13): index of the target whose shortest path is chosen.

    P̂_t = |P_t| / Σ_t |P_t| with |P_t| the hops. Among candidates P̂_t ≤ δ take the most
    hops, then least total divergence, then smallest target index; with no candidate,
    among the fewest-hop paths take the least total divergence, then smallest index.
    """
    hops = {t: len(p) - 1 for t, p in paths.items()}
    total = sum(hops.values())
    cands = [t for t in paths if hops[t] / total <= delta + 1e-12]
    if cands:
        return min(cands, key=lambda t: (-hops[t], cost[t], t))
    fewest = min(hops.values())
    return min((t for t in paths if hops[t] == fewest), key=lambda t: (cost[t], t))


def sp_selection(g: nx.Graph, delta: float) -> list[Selection]:
    """Dijkstra from every client; the δ-chosen path's clients are its neighbours."""
    out = []
    for k in sorted(g.nodes):
        cost, paths = nx.single_source_dijkstra(g, k, weight="weight")
        paths = {t: p for t, p in paths.items() if t != k}
        if not paths:
            out.append(Selection(k, [], {}, [k]))
            continue
        target = choose_path(paths, cost, delta)
        path = paths[target]
        entering = {path[i]: g[path[i - 1]][path[i]]["weight"] for i in range(1, len(path))}
        out.append(Selection(k, path[1:], entering, path))
    return out


def weights(sel: Selection) -> dict[int, float]:
    """Eq. 14: ρ_j = 1/d of j's entering edge, ρ_source = 1/min of those; ρ̂ = ρ/‖ρ‖₁."""
    if not sel.neighbours:
        return {sel.source: 1.0}
    rho = {j: 1.0 / sel.entering_edge[j] for j in sel.neighbours}
    rho[sel.source] = 1.0 / min(sel.entering_edge.values())
    norm = sum(rho.values())
    return {j: r / norm for j, r in rho.items()}


def mix(uploads: list[dict[str, torch.Tensor]], selections: list[Selection]) -> list[dict[str, torch.Tensor]]:
    """θ_k ← Σ_j ρ̂_kj θ_j for every client (eq. 14 weights), touching only the non-zero weights.

    Each client mixes 1 + |N(k)| uploads, so the cost is K·(1 + mean |N|)·n instead of the
    K²·n of a dense (K×K)·(K×n) product.
    """
    out = []
    for sel in selections:
        terms = sorted(weights(sel).items())
        mixed = {}
        for key in uploads[0]:
            j0, w0 = terms[0]
            acc = torch.mul(uploads[j0][key], w0)
            for j, w in terms[1:]:
                acc.add_(uploads[j][key], alpha=w)
            mixed[key] = acc
        out.append(mixed)
    return out


def weight_matrix(selections: list[Selection], k: int) -> torch.Tensor:
    """Row k holds client k's aggregation weights over all K uploads."""
    w = torch.zeros((k, k), dtype=torch.float64)
    for sel in selections:
        for j, v in weights(sel).items():
            w[sel.source, j] = v
    return w
