"""DRIFT's graph side (§4 of "United Yet Distinct: Domain Preservation via Divergence Reduction"):
the flat layout of uploads, MST neighbours, δ-selected shortest paths, weights, the mix.

Pure functions on tensors and networkx graphs; ``divergence`` computes the edge weights and
``plugin`` wires both into a method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedsweep.algorithms.drift.layout import _group_spans, flatten, key_spans, layout, unflatten, use_dense  # noqa: F401
from fedsweep.lazy import torch

if TYPE_CHECKING:  # imported where a graph is built: every process that imports the methods would pay for it
    import networkx as nx

def client_graph(d: torch.Tensor) -> nx.Graph:
    """Complete undirected graph on the clients (0..K-1), edge weight d_{s,t}."""
    import networkx as nx

    g = nx.Graph()
    k = d.shape[0]
    g.add_nodes_from(range(k))
    g.add_weighted_edges_from((s, t, float(d[s, t])) for s in range(k) for t in range(s + 1, k))
    return g


def detour_ratio(d: torch.Tensor) -> float:
    """max over client pairs (s, t) of d_{s,t} / min_u (d_{s,u} + d_{u,t}): the direct edge against the
    best two-hop path. At most 1, every shortest path is its direct edge, so every target is one hop
    away, P̂_t = 1/(K − 1) for every t and the δ rule (eq. 12–13) picks one neighbour whatever δ; only
    above 1 can δ change a client's path. 0 with fewer than three clients."""
    k = d.shape[0]
    if k < 3:
        return 0.0
    dd = d.double()
    via = dd[:, :, None] + dd[None, :, :]  # [s, u, t] = d_{s,u} + d_{u,t}
    idx = torch.arange(k)
    via[idx, idx, :] = math.inf  # u = s
    via[:, idx, idx] = math.inf  # u = t
    best = via.min(dim=1).values
    off = ~torch.eye(k, dtype=torch.bool)
    return float((dd[off] / best[off]).max())


@dataclass
class Selection:
    """Who client ``source`` aggregates with, and the edge that brings each one in."""

    source: int
    neighbours: list[int]
    entering_edge: dict[int, float]  # neighbour -> divergence of the edge that brings it in
    path: list[int] | None = None  # SP: the chosen path, source first


def mst_selection(g: nx.Graph) -> list[Selection]:
    """Kruskal MST (eq. 10); each client aggregates with its immediate MST neighbours."""
    import networkx as nx

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
    import networkx as nx

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


def flat_buffer(params: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    """The one flat tensor all of ``params`` are views of (as ``mix`` returns them), or None."""
    if not params:
        return None
    bases = {id(t._base) for t in params.values()}
    base = next(iter(params.values()))._base
    if len(bases) != 1 or base is None or base.dim() != 1:
        return None
    if base.numel() != sum(t.numel() for t in params.values()):
        return None
    return base


def _result_buffer(given: torch.Tensor | None, read: set[int], taken: set[int], size: int,
                   ref: torch.Tensor) -> torch.Tensor:
    """``given`` if no upload reads it, no other result took it and it fits, else a fresh buffer."""
    if given is not None:
        ptr = given.untyped_storage().data_ptr()
        if ptr in read or ptr in taken:  # an upload reads it, or another client's result lives there
            given = None
        else:
            taken.add(ptr)
    if given is None or given.numel() != size or given.dtype != ref.dtype or given.device != ref.device:
        given = torch.empty(size, dtype=ref.dtype, device=ref.device)
    return given


def mix(uploads: list[dict[str, torch.Tensor]], selections: list[Selection],
        reuse: list[torch.Tensor | None] | None = None, dense: bool | None = None,
        flat: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """θ_k ← Σ_j ρ̂_kj θ_j for every client (eq. 14 weights), touching only the non-zero weights.

    Each client mixes 1 + |N(k)| uploads, so the cost is K·(1 + mean |N|)·n instead of the
    K²·n of a dense (K×K)·(K×n) product. On a CPU with float32 uploads the C kernel of ``fused.mix``
    does it for all clients at once over column chunks (each upload read from memory once), else
    ``running_mean`` per client and tensor. Each client's result lives in one flat buffer (its
    tensors are views of it); ``reuse[i]``, where given, of the right size, read by no upload and
    given once, is overwritten instead of allocating one (the server passes the buffers of the
    previous round's results it is replacing: faulting in fresh memory costs as much as the
    arithmetic).

    The dense path (``use_dense``: accelerators; or ``flat`` given, ``flatten(uploads)`` already
    made) is one (K × K)·(K × n) product over the flattened uploads and a copy of each row into the
    client's buffer: a handful of launches instead of K · tensors · (1 + |N|). It reads
    every upload before it writes any buffer, so a buffer an upload lives in may be reused.
    """
    keys = list(uploads[0])
    sizes = [uploads[0][key].numel() for key in keys]
    ref = uploads[0][keys[0]]
    dense = flat is not None or use_dense(ref, dense)
    read: set[int] = set()
    taken: set[int] = set()
    if dense:
        lay = layout(uploads[0])
        x = flatten(uploads, ref.dtype) if flat is None else flat.to(ref.dtype)
        rows = weight_matrix(selections, len(uploads)).to(dtype=ref.dtype, device=ref.device) @ x
    elif reuse is not None:
        read = {t.untyped_storage().data_ptr() for u in uploads for t in u.values()}
    out = []
    for i, sel in enumerate(selections):
        buf = _result_buffer(reuse[i] if reuse is not None else None, read, taken, sum(sizes), ref)
        if dense:
            out.append(unflatten(buf.copy_(rows[sel.source]), lay))
            continue
        out.append({key: view.view(uploads[0][key].shape) for key, view in zip(keys, torch.split(buf, sizes))})
    if dense:
        return out
    terms = [sorted(weights(sel).items()) for sel in selections]
    import fedsweep.algorithms.drift.fused as fused

    if not fused.mix(uploads, terms, out, keys):  # the C kernel where it can run, else torch
        for mixed, t in zip(out, terms):
            for key in keys:
                running_mean(mixed[key], [uploads[j][key] for j, _ in t], [w for _, w in t])
    return out


def running_mean(out: torch.Tensor, xs: list[torch.Tensor], ws: list[float]) -> torch.Tensor:
    """Σ_j w_j x_j / Σ_j w_j into ``out``, one pass over ``out`` per term: the first two by one lerp,
    (1 − λ) x_0 + λ x_1 with λ = w_1/(w_0 + w_1), each further term by ``out.lerp_(x_j, w_j/W_j)``
    with W_j the weights so far (eq. 14's ρ̂ sum to 1, so this is Σ ρ̂_j θ_j)."""
    if len(xs) == 1:
        return out.copy_(xs[0])
    total = ws[0] + ws[1]
    torch.lerp(xs[0], xs[1], ws[1] / total, out=out)
    for x, w in zip(xs[2:], ws[2:]):
        total += w
        out.lerp_(x, w / total)
    return out


def weight_matrix(selections: list[Selection], k: int) -> torch.Tensor:
    """Row k holds client k's aggregation weights over all K uploads."""
    w = torch.zeros((k, k), dtype=torch.float64)
    for sel in selections:
        for j, v in weights(sel).items():
            w[sel.source, j] = v
    return w
