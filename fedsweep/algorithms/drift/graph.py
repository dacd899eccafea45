"""DRIFT's graph side (§4 of "United Yet Distinct: Domain Preservation via Divergence Reduction"): divergences, MST neighbours, δ-selected shortest paths, weights.

Pure functions on tensors and networkx graphs; ``drift.py`` wires them into a plugin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedsweep.lazy import torch

if TYPE_CHECKING:  # imported where a graph is built: every process that imports the methods would pay for it
    import networkx as nx

CHUNK = 1 << 16  # columns per block: a (K × CHUNK) float32 block of 16 clients is 4 MiB, cache-sized
SUB = 1024  # the block's dot products are summed in float32 over SUB columns, then in float64
EXPM1_POLY_MAX = 0.7  # |u| up to which expm1 is a Taylor polynomial (beyond: torch.expm1)


def _expm1(u: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = exp(u) − 1 with full relative precision: where |u| ≤ 0.7 a Taylor polynomial of
    the least degree whose truncation error is below 1e-7 relative (|u|^d/(d+1)! < 1e-7: degree
    2 for |u| ~ 1e-6, 5 for |u| ~ 0.1), else ``torch.expm1`` (accurate, several times slower)."""
    lo, hi = torch.aminmax(u)
    umax = max(-float(lo), float(hi))
    if umax > EXPM1_POLY_MAX:
        return torch.expm1(u, out=out)
    deg, fact = 1, 2.0
    while umax ** deg / fact >= 1e-7 and deg < 12:
        deg += 1
        fact *= deg + 1
    if deg == 1:
        return out.copy_(u)
    one = torch.ones((), dtype=u.dtype, device=u.device)
    # Horner: u(1 + u/2(1 + u/3(… (1 + u/deg))))
    acc = torch.addcmul(one, u, one, value=1.0 / deg, out=out)
    for j in range(deg - 1, 1, -1):
        torch.addcmul(one, acc, u, value=1.0 / j, out=acc)
    return acc.mul_(u)


def _dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(Ka, Kb) float64 a·bᵀ of (Ka, m) and (Kb, m) float32 blocks: float32 partial sums over SUB
    columns (one batched product), added in float64, so the rounding error does not grow with n."""
    m = a.shape[1]
    pad = (-m) % SUB
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, pad))
    nb = a.shape[1] // SUB
    aa = a.reshape(a.shape[0], nb, SUB).transpose(0, 1)
    bb = b.reshape(b.shape[0], nb, SUB).transpose(0, 1)
    return torch.bmm(aa, bb.transpose(1, 2)).sum(dim=0, dtype=torch.float64)


def _blocks(uploads: list[dict[str, torch.Tensor]], keys: list[str]):
    """(K + 1, m) float32 column blocks of u = x − x̄ (x̄ = client 0's tensors), into one reused
    buffer: rows 0..K−1 the clients' ``keys`` concatenated, row K ones (so that one product also
    gives row sums); with the block of x̄."""
    k = len(uploads)
    dev = uploads[0][keys[0]].device
    buf = torch.empty((k + 1, CHUNK), dtype=torch.float32, device=dev)
    buf[k] = 1.0
    for key in keys:
        flat = [u[key].reshape(-1).float() for u in uploads]
        n = flat[0].numel()
        for j in range(0, n, CHUNK):
            m = min(CHUNK, n - j)
            out = buf[:, :m]
            ref = flat[0][j:j + m]
            for i, f in enumerate(flat):
                torch.sub(f[j:j + m], ref, out=out[i])
            yield out, ref


def _skl_from_segment(uploads: list[dict[str, torch.Tensor]], keys: list[str]) -> torch.Tensor:
    """SKL(s, t) = Σ_i (p_s − p_t)_i (x_s − x_t)_i with p_s = softmax of client s's ``keys`` concatenated.

    Accurate where clients are nearly identical — DRIFT's regime: LoRA B starts at zero and
    every client starts from the same A — where the direct form p_s·x_s − p_s·x_t + …
    subtracts numbers of the size of x to get one of the size of the perturbation squared.
    Here everything is expanded around a reference x̄ (client 0; any common vector works):

        u_s = x_s − x̄,   q = softmax(x̄) = w/Q,   a_s = expm1(u_s),   α_s = q·a_s,
        p_s − q = q ⊙ (a_s − α_s)/(1 + α_s)             (exact: p_s ∝ q ⊙ exp(u_s))
        G_st = (p_s − q)·u_t = (H_st − α_s h_t) / (Q (1 + α_s)),  H = (a ⊙ w) uᵀ,  h = u w
        SKL(s, t) = (p_s − p_t)·(u_s − u_t) = G_ss − G_st − G_ts + G_tt

    a and u are of the size of the perturbation and a keeps its relative precision (expm1),
    so float32 storage suffices; dot products are summed in float64 (``_dots``): one product
    [a ⊙ w; w]·[u; 1]ᵀ per block gives H, h, Σ a ⊙ w and Q together. One read of the uploads,
    block by block in cache; a running maximum of x̄ rescales the accumulators (online
    softmax). Relative error ≤ 1e-6 against a float64 per-pair reference down to
    perturbations of 1e-6 (tested).
    """
    k = len(uploads)
    dev = uploads[0][keys[0]].device
    acc = torch.zeros((k + 1, k + 1), dtype=torch.float64, device=dev)
    m_run = None
    aw = torch.empty((k + 1, CHUNK), dtype=torch.float32, device=dev)
    for x, r in _blocks(uploads, keys):
        m = x.shape[1]
        m_blk = float(r.max())
        if m_run is None or m_blk > m_run:
            if m_run is not None:
                acc *= math.exp(m_run - m_blk)
            m_run = m_blk
        u = x[:k]
        awb = aw[:, :m]
        w = torch.sub(r, m_run, out=awb[k]).exp_()
        _expm1(u, out=awb[:k]).mul_(w)
        acc += _dots(awb, x)
    return _skl_from_acc(acc, k)


def _skl_from_acc(acc: torch.Tensor, k: int) -> torch.Tensor:
    """SKL from the accumulated [a ⊙ w; w]·[u; 1]ᵀ (K + 1 × K + 1, float64); see ``_skl_from_segment``."""
    hh, sa, h, q_sum = acc[:k, :k], acc[:k, k], acc[k, :k], acc[k, k]
    alpha = sa / q_sum
    g = (hh - alpha[:, None] * h[None, :]) / (q_sum * (1.0 + alpha))[:, None]
    diag = g.diagonal()
    return diag[:, None] + diag[None, :] - g - g.T


def layout(upload: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], list[str]]]:
    """The dense path's flat layout: keys grouped by shape, groups and keys in sorted order.

    Equal shapes side by side let a group be written with one ``stack`` and read back with one
    ``unbind`` instead of a view per tensor (a LoRA adapter has a few shapes and hundreds of
    tensors; per-tensor views cost more than the arithmetic on an accelerator)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for key in sorted(upload):
        groups.setdefault(tuple(upload[key].shape), []).append(key)
    return sorted(groups.items())


def _group_spans(lay: list[tuple[tuple[int, ...], list[str]]]):
    off = 0
    for shape, keys in lay:
        m = math.prod(shape) * len(keys)
        yield shape, keys, off, off + m
        off += m


def _key_spans(lay: list[tuple[tuple[int, ...], list[str]]]):
    for shape, keys, a, _ in _group_spans(lay):
        m = math.prod(shape)
        for j, key in enumerate(keys):
            yield key, a + j * m, a + (j + 1) * m


def flatten(uploads: list[dict[str, torch.Tensor]], dtype: torch.dtype | None = None) -> torch.Tensor:
    """(K, n) matrix whose row s is client s's tensors in ``layout`` order: one stack per shape group
    (``dtype``: float32 unless given)."""
    dtype = torch.float32 if dtype is None else dtype
    spans = list(_group_spans(layout(uploads[0])))
    x = torch.empty((len(uploads), spans[-1][3]), dtype=dtype, device=next(iter(uploads[0].values())).device)
    for i, u in enumerate(uploads):
        for shape, keys, a, b in spans:
            dst = x[i, a:b].view(len(keys), *shape)
            group = [u[key] for key in keys]
            if group[0].dtype == dtype:
                torch.stack(group, out=dst)
            else:
                dst.copy_(torch.stack(group))
    return x


def unflatten(row: torch.Tensor, lay: list[tuple[tuple[int, ...], list[str]]]) -> dict[str, torch.Tensor]:
    """Views of ``row`` (a ``flatten`` row) by key."""
    out = {}
    for shape, keys, a, b in _group_spans(lay):
        out.update(zip(keys, row[a:b].view(len(keys), *shape).unbind(0)))
    return out


def _skl_dense(x: torch.Tensor) -> torch.Tensor:
    """``_skl_from_segment`` on a (K, n) matrix in one block: the same expansion around x̄ = row 0,
    each step one kernel over the whole matrix and one host sync in all. For accelerators, where
    the blocked loop is bound by thousands of small launches; memory (3 × K × n float32) is cheap
    there."""
    k, n = x.shape
    npad = n + (-n) % SUB  # zero columns add nothing to any dot product
    ux = x.new_zeros((k + 1, npad))
    ux[k, :n] = 1.0
    ref = x[0]
    torch.sub(x, ref, out=ux[:k, :n])
    aw = x.new_zeros((k + 1, npad))
    w = torch.sub(ref, ref.max(), out=aw[k, :n]).exp_()
    torch.expm1(ux[:k, :n], out=aw[:k, :n]).mul_(w)
    return _skl_from_acc(_dots(aw, ux), k)


def _identical_rows_dense(x: torch.Tensor) -> torch.Tensor:
    """``_identical_rows`` on the flattened matrix: the first 4096 columns compared for all pairs in
    one kernel, whole rows only for the pairs still equal."""
    k = x.shape[0]
    head = x[:, :4096]
    same = (head[:, None, :] == head[None, :, :]).all(dim=-1).cpu()
    for s in range(k - 1):
        for t in range(s + 1, k):
            if same[s, t] and not torch.equal(x[s], x[t]):
                same[s, t] = same[t, s] = False
    return same


def use_dense(t: torch.Tensor, dense: bool | None) -> bool:
    """The whole-matrix path where asked, else on any device but the CPU (where the blocked,
    cache-sized path is faster and needs no K × n copies)."""
    return t.device.type != "cpu" if dense is None else dense


def _identical_rows(uploads: list[dict[str, torch.Tensor]], keys: list[str]) -> torch.Tensor:
    """(K, K) bool: clients whose tensors are equal entry by entry (their divergence is exactly 0).

    Compared key by key, only for the pairs still equal: distinct clients drop out at the
    first tensor, so the check costs one tensor unless clients really are identical.
    """
    k = len(uploads)
    same = torch.ones((k, k), dtype=torch.bool)
    for key in keys:
        if not bool(same.triu(1).any()):
            break
        for s in range(k - 1):
            for t in range(s + 1, k):
                if same[s, t] and not torch.equal(uploads[s][key], uploads[t][key]):
                    same[s, t] = same[t, s] = False
    return same


def _finish(skl: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    skl = (0.5 * (skl + skl.T)).clamp_min(0.0).cpu()  # exactly symmetric
    skl[same] = 0.0
    return skl


def divergence_matrix(uploads: list[dict[str, torch.Tensor]], eps: float, scope: str = "client",
                      dense: bool | None = None, flat: torch.Tensor | None = None) -> torch.Tensor:
    """d_{s,t} = KL(p_s‖p_t) + KL(p_t‖p_s) (eq. 6–8); off-diagonal entries floored at ``eps``.

    ``scope="client"`` (eq. 8 read literally, the default): one distribution p_Θs = softmax of the
    concatenation of all of client s's adapter tensors. ``scope="tensor"``: one softmax per
    adapter tensor, the divergences summed over tensors. Clients with equal tensors get
    exactly ``eps``. ``dense`` picks the whole-matrix path (``use_dense``); ``flat``, where given,
    is ``flatten(uploads)`` already made (and implies it).
    """
    keys = sorted(uploads[0])
    k = len(uploads)
    if scope not in ("client", "tensor"):
        raise ValueError(f"drift scope must be 'client' or 'tensor', not {scope!r}")
    if flat is not None or use_dense(uploads[0][keys[0]], dense):
        x = (flatten(uploads) if flat is None else flat).float()
        same = _identical_rows_dense(x)
        if scope == "client":  # the concatenation's order does not change a softmax's divergences
            total = _finish(_skl_dense(x), same)
        else:
            total = sum(_finish(_skl_dense(x[:, a:b]), same) for _, a, b in _key_spans(layout(uploads[0])))
    else:
        same = _identical_rows(uploads, keys)
        if scope == "client":
            total = _finish(_skl_from_segment(uploads, keys), same)
        else:
            total = sum(_finish(_skl_from_segment(uploads, [key]), same) for key in keys)
    off = ~torch.eye(k, dtype=torch.bool)
    total[off] = total[off].clamp_min(eps)
    total.fill_diagonal_(0.0)
    return total


def client_graph(d: torch.Tensor) -> nx.Graph:
    """Complete undirected graph on the clients (0..K-1), edge weight d_{s,t}."""
    import networkx as nx

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
    K²·n of a dense (K×K)·(K×n) product. Each client's result lives in one flat buffer (its
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
        terms = sorted(weights(sel).items())
        mixed = {}
        for key, view in zip(keys, torch.split(buf, sizes)):
            view = view.view(uploads[0][key].shape)
            j0, w0 = terms[0]
            torch.mul(uploads[j0][key], w0, out=view)
            for j, w in terms[1:]:
                view.add_(uploads[j][key], alpha=w)
            mixed[key] = view
        out.append(mixed)
    return out


def weight_matrix(selections: list[Selection], k: int) -> torch.Tensor:
    """Row k holds client k's aggregation weights over all K uploads."""
    w = torch.zeros((k, k), dtype=torch.float64)
    for sel in selections:
        for j, v in weights(sel).items():
            w[sel.source, j] = v
    return w
