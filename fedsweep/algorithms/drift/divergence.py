"""DRIFT's client divergences (eq. 6–8 of "United Yet Distinct: Domain Preservation via Divergence
Reduction"), accurate in every regime: near-identical, clustered and widely spread clients.

    d_{s,t} = KL(p_s‖p_t) + KL(p_t‖p_s) = Σ_i (p_s − p_t)_i (x_s − x_t)_i,   p_s = softmax(x_s)

The direct form subtracts numbers of the size of x to get one of the size of (x_s − x_t)², so it
loses every digit when clients are close — DRIFT's regime, LoRA B starting at zero. Each pair is
therefore computed around a *reference* client R close to it, in float64:

    u_s = x_s − x_R (exact: the uploads are float32),  w = exp(x_R − max x_R),  Q = Σ w,
    a_s = expm1(u_s),  α_s = Σ w a_s / Q,   p_s − q = q ⊙ (a_s − α_s)/(1 + α_s)   (exact)
    G_st = (p_s − q)·u_t = (H_st − α_s h_t) / (Q (1 + α_s)),   H = (a ⊙ w) uᵀ,  h = u w
    d_{s,t} = (p_s − p_t)·(u_s − u_t) = G_ss − G_st − G_ts + G_tt

One read of the uploads per reference, block by block (a running maximum of x_R rescales the
sums, as in an online softmax), and one K×K product per block.

The error bound a pair is accepted on. Norms are q-weighted L2 (q = w/Q, Σ q = 1): A_s = ‖a_s‖,
M_s = ‖u_s‖, and N_s = (A_s + |α_s|)/(1 + α_s) ≥ ‖(a_s − α_s)/(1 + α_s)‖. Every float64 sum above
(H, h, α) carries an absolute error of at most c·ε times the sum of its terms' magnitudes, with c
the worst case of any summation order (:func:`summation_constant`: a block's width plus the number
of blocks, plus a few roundings more), and by Cauchy–Schwarz Σ q |a_s||u_t| ≤ A_s M_t,
Σ q |a_s| ≤ A_s. The s-half of d, (G_ss − G_st) = (p_s − q)·(u_s − u_t), has magnitude
≤ N_s (M_s + M_t) and is computed with

  * the rounding of its numerator, H_ss − H_st − α_s(h_s − h_t): ≤ c ε N_s (M_s + M_t) after the
    division by Q(1 + α_s);
  * the relative error of its denominator 1 + α_s, whose α_s is off by ≤ c ε A_s: a relative
    error ≤ c ε κ_s, κ_s = A_s/(1 + α_s), on the whole half, ≤ c ε κ_s N_s (M_s + M_t).

So |d̂ − d| ≤ c ε (M_s + M_t)[N_s(1 + κ_s) + N_t(1 + κ_t)] (the code takes twice that). (A first
version left out the κ terms, the cancellation in 1 + α_s when a client's softmax mass lies where
the reference's is small; as κ_s ≤ N_s + 1 it could under-estimate the error by a factor of about
N. It also took c = 64, which no summation of 10⁷ terms guarantees.) A_s and M_s are bounded from
H's diagonal (:func:`around_reference`).

*The fast pass.* expm1 costs four times exp on a CPU. Around each reference a first pass takes
e_s = exp(u_s) instead and sums Σ w e_s u_t and Σ w e_s, from which H_st = Σ w e_s u_t − h_t and
1 + α_s = Σ w e_s / Q follow (the latter now without cancellation). Two things change:

  * e_s is exp's result, off by one rounding: exactly the expansion of a client x_s + δ_s with
    |δ_s| ≤ η ≈ 2ε entry by entry, so p_s is that of softmax(x_s + δ_s), within a factor e^{±2η}
    entry by entry, and d moves by at most 2.01 η Σ (p_s + p_t)|u_s − u_t|;
  * the subtractions of h_t and of 1 put on H_st/Q and α_s absolute errors of c ε Σ q e_s |u_t| =
    c ε (1 + α_s) Σ p_s |u_t| and c ε (1 + α_s); in G_st, after the division by 1 + α_s, that is
    c ε (Σ p_s |u_t| + M_t).

With Σ p_s |v| ≤ (Σ p_s v²)^½ ≤ S_s ‖v‖ (q-weighted), S_s = (max p_s/q)^½ ≤ (e^{max u_s}/(1 + α_s))^½,
and S_s ≥ 1, both are within 2 c ε (M_s + M_t)(S_s + S_t); the fast pass adds 3 S_s to N_s(1 + κ_s).
Its norms come from the extremes of u (M_s ≤ max |u_s|, A_s ≤ max |a_s|), as H's diagonal is itself
a difference there. Near-identical clients (M ≈ S ≈ 1 against d ≈ M²) are not accepted by it and
go on to the precise pass with expm1 around the same reference. The fast pass runs on CPUs only
(on an accelerator both cost a memory read), through the C kernel of ``fused`` where one can be
built (the same sums in one read, with its own summation constant), else through torch.

A pair is accepted where its bound, relative to d, is within ``TOLERANCE`` (1e-7, a tenth of the
1e-6 the project asks). A pair not accepted (two clients close to each other but far from R:
clustered domains) is computed again around a reference chosen among the pairs still open — the
client in most of them — so clusters get a reference of their own; a client whose 1 + α_s is not
larger than its own rounding is not expanded around that reference at all.
Pairs that contain the reference and are still not accepted (a client that is the others plus
a constant) or whose expm1 overflowed (entries more than 709 apart) go to ``pair_divergence``, an
exact per-pair form of non-negative terms. No result depends on the upload order beyond rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from fedsweep.algorithms.drift.layout import flatten, key_spans, layout, pack_layout, summation_constant, use_dense  # noqa: F401
from fedsweep.lazy import torch

CHUNK = 1 << 14  # float64 columns per block: two (K × CHUNK) float64 buffers of 2 MiB each at K = 16
TOLERANCE = 1e-7  # a pair is accepted where its error bound is within this, relative (the target is 1e-6)
EPS = 2.0 ** -52  # float64's machine epsilon
EXP_SAFE = 50.0  # |v| up to which exp(v) and expm1(v) are taken directly in the per-pair form


class NonFinite(ValueError):
    """A pair's divergence is not finite: one of its uploads holds a NaN or an infinity."""


class Stats:
    """How the last ``pairwise`` call went: references used, pairs the fast pass settled, fast passes
    that ran through the C kernel, pairs sent to the per-pair form."""

    def __init__(self) -> None:
        self.references: list[int] = []
        self.fast: int = 0
        self.kernel_passes: int = 0
        self.per_pair: int = 0


def around_reference(blocks: PackedBlocks | MatrixBlocks, rows: list[int], ref: int,
                     fast: bool = False, stats: Stats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, bound) for every pair of ``rows`` expanded around ``rows[ref]`` (module docstring):
    ``bound`` is an upper bound on |d̂ − d| / |d̂|, the pair's relative error.

    ``d`` and ``bound`` are (k, k) float64 on the blocks' device; an entry of ``d`` is NaN where a
    client's exponential overflowed (its entries exceed the reference's by more than ~709) or its
    1 + α_s is lost in rounding.

    ``fast=False`` (the precise pass) takes a_s = expm1(u_s), relative to every digit, and bounds the
    q-weighted norms from H's diagonal, Σ w a u, without another pass: a u ≥ u² e^{min(u, 0)} and
    a² ≤ a u e^{max(u, 0)} entry by entry, so Σ w u² ≤ e^{max(−u)} H_ss and Σ w a² ≤ e^{max u} H_ss.
    ``fast=True`` takes e_s = exp(u_s) — a quarter of expm1's cost — and the sums Σ w e_s u_t and
    Σ w e_s, from which it subtracts h_t and Q; its error bound has the extra term S (module
    docstring) and takes the norms from the extremes of u."""
    sums = None
    if fast and isinstance(blocks, PackedBlocks) and blocks.fusable:
        import fedsweep.algorithms.drift.fused as fused

        sums = fused.block_sums(blocks, rows, ref)  # None where the C kernel cannot be had or is out of range
        if sums is not None and stats is not None:
            stats.kernel_passes += 1
    if sums is None:
        sums = block_sums(blocks, rows, ref, fast)
    return divergences_and_bounds(*sums[:-1], fast=fast, c=sums[-1])


def block_sums(blocks: PackedBlocks | MatrixBlocks, rows: list[int], ref: int, fast: bool) -> tuple:
    """One read of ``rows`` around ``rows[ref]``, block by block: (H, Σ w a_s, h, Q, max u_s, min u_s,
    c), with a = e^u (``fast``) or expm1(u), all rescaled to the running maximum of x_R, and c the
    summation constant of the blocks read."""
    k = len(rows)
    dev = blocks.device
    f64 = torch.float64
    u = torch.empty((k, blocks.width), dtype=f64, device=dev)
    aw = torch.empty_like(u)
    w_buf = torch.empty(blocks.width, dtype=f64, device=dev)
    hh = torch.zeros((k, k), dtype=f64, device=dev)
    sa, h = torch.zeros(k, dtype=f64, device=dev), torch.zeros(k, dtype=f64, device=dev)
    q_sum = torch.zeros((), dtype=f64, device=dev)
    umax = torch.full((k,), -math.inf, dtype=f64, device=dev)
    umin = torch.full((k,), math.inf, dtype=f64, device=dev)
    m_run = -math.inf
    n_blocks = 0
    exp = torch.exp if fast else torch.expm1
    for xr, m in blocks(rows, ref, u):  # writes u = x − x_R (float64) into u's first m columns
        n_blocks += 1
        m_blk = float(xr.max())
        if m_blk > m_run:
            if m_run > -math.inf:
                scale = math.exp(m_run - m_blk)
                for t in (hh, sa, h, q_sum):
                    t.mul_(scale)
            m_run = m_blk
        ub, awb = u[:, :m], aw[:, :m]
        torch.maximum(umax, torch.amax(ub, dim=1), out=umax)
        torch.minimum(umin, torch.amin(ub, dim=1), out=umin)
        w = torch.sub(xr, m_run, out=w_buf[:m]).exp_()
        exp(ub, out=awb).mul_(w)
        hh.addmm_(awb, ub.T)  # a (K × K) product: (K + 1) × (K + 1) would run at two thirds the speed
        sa.add_(awb.sum(dim=1))
        h.addmv_(ub, w)
        q_sum.add_(w.sum())
    return hh, sa, h, q_sum, umax, umin, summation_constant(blocks.width, n_blocks)


def divergences_and_bounds(hh: torch.Tensor, sa: torch.Tensor, h: torch.Tensor, q_sum: torch.Tensor,
                           umax: torch.Tensor, umin: torch.Tensor, *, fast: bool,
                           c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, bound) from :func:`block_sums` (module docstring: G, d and the error bound of each pass)."""
    if fast:  # sa = Σ w e_s and hh = Σ w e_s u_t: 1 + α_s without cancellation, H_st = hh_st − h_t
        one_alpha = sa / q_sum
        alpha = one_alpha - 1.0
        hh = hh - h[None, :]  # its diagonal is a difference now: the norms come from the extremes of u
        norm_u = torch.maximum(umax, -umin).clamp_min(0.0)  # ≥ max |u_s| ≥ M_s
        norm_a = torch.maximum(torch.expm1(umax), -torch.expm1(umin)).clamp_min(0.0)  # ≥ max |a_s| ≥ A_s
        spread = torch.sqrt(torch.exp(umax.clamp_min(0.0)) / one_alpha)  # S_s ≥ max (p_s / q)^½
    else:
        alpha = sa / q_sum
        one_alpha = 1.0 + alpha
        h_ss = hh.diagonal().clamp_min(0.0) / q_sum
        norm_a = torch.sqrt(h_ss * torch.exp(umax.clamp_min(0.0)))  # ≥ A_s = ‖a_s‖
        norm_u = torch.sqrt(h_ss * torch.exp((-umin).clamp_min(0.0)))  # ≥ M_s = ‖u_s‖ (all q-weighted)
        spread = torch.zeros_like(norm_u)
    g = (hh - alpha[:, None] * h[None, :]) / (q_sum * one_alpha)[:, None]
    diag = g.diagonal()
    d = diag[:, None] + diag[None, :] - g - g.T
    norm_p = (norm_a + alpha.abs()) / one_alpha  # N_s ≥ ‖(a_s − α_s)/(1 + α_s)‖
    weight = norm_p * (1.0 + norm_a / one_alpha) + 3.0 * spread  # N_s (1 + κ_s) + 3 S_s
    bound = 2.0 * c * EPS * (weight[:, None] + weight[None, :]) * (norm_u[:, None] + norm_u[None, :]) / d.abs()
    # a client whose 1 + α_s is within its own rounding cannot be expanded around this reference
    bad = ~(torch.isfinite(hh).all(dim=1) & torch.isfinite(sa)) | ~(one_alpha > c * EPS * norm_a)
    d[bad, :] = float("nan")
    d[:, bad] = float("nan")
    return d, bound


def pair_divergence(xs: torch.Tensor, xt: torch.Tensor) -> float:
    """d_{s,t} for one pair, float64, exact in every regime (the fallback and a second opinion).

    With Δ = x_t − x_s, c = p_s·Δ, v = Δ − c and L = log Σ p_s e^v (= log1p Σ p_s expm1(v), or a
    log-sum-exp where v is large), r = v − L = log p_t − log p_s and

        d_{s,t} = Σ_i (p_t − p_s)_i r_i = Σ_i p_s,i expm1(r_i) r_i

    (Σ(p_t − p_s) = 0 lets any constant be subtracted from Δ): every term is ≥ 0, so nothing
    cancels. Where r_i > 50 the term is (p_t,i − p_s,i) r_i with p_t,i = exp(log p_s,i + r_i) ≤ 1:
    nothing overflows."""
    xs = xs.reshape(-1).double()
    xt = xt.reshape(-1).double()
    logp = xs - torch.logsumexp(xs, 0)
    p = logp.exp()
    delta = xt - xs
    v = delta - (p * delta).sum()
    if float(v.max()) <= EXP_SAFE:
        big_l = math.log1p(float((p * torch.expm1(v)).sum()))
    else:
        big_l = float(torch.logsumexp(logp + v, 0))
    r = v - big_l
    small = r <= EXP_SAFE
    term = torch.where(small, p * torch.expm1(r.clamp(max=EXP_SAFE)), torch.exp(logp + r) - p) * r
    return float(term.sum())


def choose_reference(pending: torch.Tensor) -> int:
    """The client in the most open pairs (smallest index on ties): in a cluster, near its pairs."""
    counts = (pending | pending.T).sum(dim=1)
    return int(torch.nonzero(counts == counts.max())[0, 0])


def pairwise(blocks: PackedBlocks | MatrixBlocks, same: torch.Tensor,
             pair_rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
             stats: Stats | None = None) -> torch.Tensor:
    """(K, K) float64 CPU matrix of d_{s,t} (0 where ``same``, the (K, K) bool of identical
    clients), each pair's error bound within ``TOLERANCE`` around some reference (module
    docstring); ``pair_rows(s, t)`` gives the two clients' flat rows for ``pair_divergence``.

    Around each reference the fast pass goes first; the pairs it leaves, the precise pass."""
    stats = stats if stats is not None else Stats()
    k = same.shape[0]
    out = torch.zeros((k, k), dtype=torch.float64)
    pending = torch.ones((k, k), dtype=torch.bool).triu(1) & ~same
    while bool(pending.any()):
        ref = choose_reference(pending)
        stats.references.append(ref)
        for fast in ((True, False) if blocks.device.type == "cpu" else (False,)):
            involved = (pending | pending.T).any(dim=1)
            if not bool(involved.any()):
                break
            involved[ref] = True
            rows = torch.nonzero(involved).flatten()
            d, bound = (t.cpu() for t in around_reference(blocks, rows.tolist(),
                                                          int((rows == ref).nonzero()[0, 0]), fast, stats))
            full_d = torch.full((k, k), math.nan, dtype=torch.float64)
            full_b = torch.full((k, k), math.inf, dtype=torch.float64)
            full_d[rows[:, None], rows[None, :]] = d
            full_b[rows[:, None], rows[None, :]] = bound
            ok = pending & torch.isfinite(full_d) & (full_d > 0) & (full_b <= TOLERANCE)
            out[ok] = full_d[ok]
            pending &= ~ok
            if fast:
                stats.fast += int(ok.sum())
        for t in torch.nonzero(pending[ref]).flatten().tolist() + torch.nonzero(pending[:, ref]).flatten().tolist():
            s, t = min(ref, t), max(ref, t)  # no nearer reference exists: the exact per-pair form
            out[s, t] = pair_divergence(*pair_rows(s, t))
            stats.per_pair += 1
            if not math.isfinite(float(out[s, t])):
                raise NonFinite(s, t)
        pending[ref, :] = False
        pending[:, ref] = False
    return out + out.T


class PackedBlocks:
    """Column blocks of the clients' ``keys`` concatenated, packed across tensors: a call
    ``(rows, ref, out)`` writes u = x − x_R of each row into ``out`` (float64) and yields
    (x_R's block in float64, its width). ``layout`` lists each block's pieces,
    (tensor, start, length, column), and its width."""

    def __init__(self, uploads: list[dict[str, torch.Tensor]], keys: list[str], width: int | None = None):
        self.flats = [[u[key].reshape(-1) for key in keys] for u in uploads]
        self.width = max(1, min(width or CHUNK, sum(t.numel() for t in self.flats[0])))
        self.device = self.flats[0][0].device
        self.layout = pack_layout([t.numel() for t in self.flats[0]], self.width)
        self.fusable = self.device.type == "cpu" and all(t.dtype == torch.float32 for f in self.flats for t in f)
        self.kernel_plan = None  # the layout as the C kernel reads it (fused.Plan), made on first use

    def __call__(self, rows: list[int], ref: int, out: torch.Tensor) -> Iterator[tuple[torch.Tensor, int]]:
        xr = torch.empty(self.width, dtype=torch.float64, device=self.device)
        targets: dict[tuple[int, int], list[torch.Tensor]] = {}  # the same few row slices recur
        for pieces, width in self.layout:
            for j, start, m, fill in pieces:
                if (fill, m) not in targets:
                    targets[fill, m] = [out[i, fill:fill + m] for i in range(len(rows))]
                for target, r in zip(targets[fill, m], rows):  # converts to float64: exact for float32
                    target.copy_(self.flats[r][j][start:start + m])
            yield centre(out, ref, xr, width)


def centre(out: torch.Tensor, ref: int, xr: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
    """u = x − x_R in place over the first ``m`` columns of ``out``, which hold x in float64 (exact
    for float32 values); (x_R's columns, kept in ``xr``, m)."""
    xr = xr[:m]
    xr.copy_(out[ref, :m])
    out[:, :m].sub_(xr)
    return xr, m


class MatrixBlocks:
    """The same over a flattened (K, n) matrix's columns, a few wide blocks (accelerators)."""

    def __init__(self, x: torch.Tensor, width: int):
        self.x = x
        self.width = max(1, min(width, x.shape[1]))
        self.device = x.device

    def __call__(self, rows: list[int], ref: int, out: torch.Tensor) -> Iterator[tuple[torch.Tensor, int]]:
        idx = torch.tensor(rows, device=self.device)
        xr = torch.empty(self.width, dtype=torch.float64, device=self.device)
        for c in range(0, self.x.shape[1], self.width):
            block = self.x[idx, c:c + self.width]
            out[:, :block.shape[1]].copy_(block)
            yield centre(out, ref, xr, block.shape[1])


DENSE_WIDTH = 1 << 21  # accelerators: a few large blocks (launch-bound otherwise), 4 × K × 16 MiB of scratch


def identical_rows(head: torch.Tensor, equal: Callable[[int, int], bool]) -> torch.Tensor:
    """(K, K) bool: clients whose values are equal entry by entry (their divergence is exactly 0):
    ``head`` (K, h), a few leading values of each, screens all pairs in one comparison; ``equal``
    decides the pairs it leaves."""
    k = head.shape[0]
    same = (head[:, None, :] == head[None, :, :]).all(dim=-1).cpu()
    for s in range(k - 1):
        for t in range(s + 1, k):
            if same[s, t] and not equal(s, t):
                same[s, t] = same[t, s] = False
    return same


def _segments(uploads: list[dict[str, torch.Tensor]], scope: str, dense: bool | None, flat: torch.Tensor | None):
    """(blocks, same, pair_rows) of each segment: the whole adapter (``client``) or one per tensor."""
    keys = sorted(uploads[0])
    if flat is not None or use_dense(uploads[0][keys[0]], dense):
        x = flatten(uploads) if flat is None else flat
        spans = [(0, x.shape[1])] if scope == "client" else [(a, b) for _, a, b in key_spans(layout(uploads[0]))]
        for a, b in spans:
            seg = x[:, a:b]
            same = identical_rows(seg[:, :64], lambda s, t, seg=seg: torch.equal(seg[s], seg[t]))
            yield MatrixBlocks(seg, DENSE_WIDTH), same, lambda s, t, seg=seg: (seg[s], seg[t])
        return
    for seg in ([keys] if scope == "client" else [[key] for key in keys]):
        head = torch.stack([u[seg[0]].reshape(-1)[:64] for u in uploads])
        same = identical_rows(head, lambda s, t, seg=seg: all(torch.equal(uploads[s][key], uploads[t][key])
                                                              for key in seg))
        yield (PackedBlocks(uploads, seg), same,
               lambda s, t, seg=seg: tuple(torch.cat([uploads[c][key].reshape(-1) for key in seg]) for c in (s, t)))


def divergence_matrix(uploads: list[dict[str, torch.Tensor]], eps: float, scope: str = "client",
                      dense: bool | None = None, flat: torch.Tensor | None = None,
                      stats: Stats | None = None) -> torch.Tensor:
    """d_{s,t} = KL(p_s‖p_t) + KL(p_t‖p_s) (eq. 6–8), (K, K) float64 on the CPU; off-diagonal
    entries floored at ``eps``, so identical clients get exactly ``eps``.

    ``scope="client"`` (eq. 8 read literally, the default): one distribution p_Θs = softmax of the
    concatenation of all of client s's adapter tensors. ``scope="tensor"``: one softmax per
    adapter tensor, the divergences summed over tensors. ``dense`` picks the path for
    accelerators (a few wide blocks of ``graph.flatten``'s matrix; ``graph.use_dense``); ``flat``,
    where given, is that matrix already made (and implies it). Raises ``ValueError`` on a
    non-finite upload (the server screens those out first)."""
    if scope not in ("client", "tensor"):
        raise ValueError(f"drift scope must be 'client' or 'tensor', not {scope!r}")
    k = len(uploads)
    total = torch.zeros((k, k), dtype=torch.float64)
    try:
        for blocks, same, pair_rows in _segments(uploads, scope, dense, flat):
            total += pairwise(blocks, same, pair_rows, stats)
    except NonFinite:
        bad = [i for i, u in enumerate(uploads) if not all(bool(torch.isfinite(t).all()) for t in u.values())]
        raise ValueError(f"drift: non-finite values in the uploads of client(s) {bad}; screen them out first") from None
    off = ~torch.eye(k, dtype=torch.bool)
    total[off] = total[off].clamp_min(eps)
    total.fill_diagonal_(0.0)
    return total
