"""DRIFT's divergences in every regime, as a property over seeded draws: each pair of every draw
against an independent float64 computation (``pair_divergence``'s form of non-negative terms,
itself checked against mpmath here), on both paths (the CPU's blocked expansion and the dense one of
accelerators, also cut into many blocks so the running maximum's rescaling is exercised) and both
scopes (one softmax over the whole adapter; one per tensor, summed).

Regimes: clients whose tensors differ in scale by up to six orders of magnitude within one client
(N(0, 1)·σ, σ per tensor from {1e-3, 1, 30} or log-uniform over 1e-4..1e2), with per-tensor offsets,
clustered clients (three centres, small spreads), widely spread ones, near-identical ones (1e-5 of
the scale apart), and a reference-hostile one (one client's softmax mass where the others have
none: its expansion's 1 + α is tiny).
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import torch

from fedsweep.algorithms.drift import divergence as dv

SHAPES = [(4, 16), (32, 4), (8, 64), (3, 5, 2), (7,)]
REGIMES = ["scales", "scales_shared", "offsets", "clustered", "spread", "near", "hostile"]


def draw(regime: str, seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng([seed, REGIMES.index(regime)])
    k = int(rng.integers(4, 9))
    logu = rng.random() < 0.5

    def sigma() -> float:
        return float(np.exp(rng.uniform(np.log(1e-4), np.log(1e2)))) if logu else float(rng.choice([1e-3, 1.0, 30.0]))

    shared = [sigma() for _ in SHAPES]
    centres = [[rng.standard_normal(s) * sigma() for s in SHAPES] for _ in range(3)]
    out = []
    for c in range(k):
        u = {}
        for j, shape in enumerate(SHAPES):
            if regime == "scales":
                v = rng.standard_normal(shape) * sigma()
            elif regime == "scales_shared":
                v = rng.standard_normal(shape) * shared[j]
            elif regime == "offsets":
                v = rng.standard_normal(shape) * sigma() + rng.normal() * sigma()
            elif regime == "clustered":
                v = centres[c % 3][j] + rng.standard_normal(shape) * shared[j] * 10.0 ** rng.uniform(-5, -1)
            elif regime == "spread":
                v = rng.standard_normal(shape) * 30.0 + rng.normal() * 30.0
            elif regime == "near":
                v = centres[0][j] + rng.standard_normal(shape) * shared[j] * 1e-5
            else:  # hostile: client 0 has one entry far above everything; the rest are small
                v = rng.standard_normal(shape) * 0.5
                if c == 0 and j == 2:
                    v.flat[int(rng.integers(v.size))] = 25.0 + 15.0 * rng.random()
            u[f"t{j}"] = torch.tensor(v, dtype=torch.float32)
        out.append(u)
    return out


def reference(ups: list[dict[str, torch.Tensor]], scope: str) -> np.ndarray:
    k, keys = len(ups), sorted(ups[0])
    groups = [keys] if scope == "client" else [[key] for key in keys]
    out = np.zeros((k, k))
    for s in range(k):
        for t in range(s + 1, k):
            out[s, t] = out[t, s] = sum(dv.pair_divergence(torch.cat([ups[s][key].reshape(-1) for key in g]),
                                                           torch.cat([ups[t][key].reshape(-1) for key in g]))
                                        for g in groups)
    return out


def mp_divergence(xs: np.ndarray, xt: np.ndarray, digits: int = 150) -> float:
    """d = Σ (p_s − p_t)(x_s − x_t) at ``digits`` decimal digits (the entries are exact binary numbers)."""
    with mpmath.workdps(digits):
        def probs(x):
            m = max(mpmath.mpf(float(v)) for v in x)
            e = [mpmath.exp(mpmath.mpf(float(v)) - m) for v in x]
            z = mpmath.fsum(e)
            return [v / z for v in e]

        ps, pt = probs(xs), probs(xt)
        return float(mpmath.fsum((a - b) * (mpmath.mpf(float(x)) - mpmath.mpf(float(y)))
                                 for a, b, x, y in zip(ps, pt, xs, xt)))


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    off = ~np.eye(len(want), dtype=bool)
    return float((np.abs(got - want)[off] / np.abs(want[off])).max())


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("scope", ["client", "tensor"])
def test_every_pair_of_every_draw_is_within_1e6_of_float64_on_both_paths(regime, scope, monkeypatch):
    worst = 0.0
    for seed in range(12):
        ups = draw(regime, seed)
        want = reference(ups, scope)
        for dense in (False, True):
            got = dv.divergence_matrix(ups, 0.0, scope, dense=dense).numpy()
            worst = max(worst, _relative(got, want))
        with monkeypatch.context() as m:  # many small blocks: the running maximum rescales the sums
            m.setattr(dv, "CHUNK", 37)
            m.setattr(dv, "DENSE_WIDTH", 53)
            for dense in (False, True):
                worst = max(worst, _relative(dv.divergence_matrix(ups, 0.0, scope, dense=dense).numpy(), want))
    assert worst <= 1e-6, f"{regime}/{scope}: a pair is off by {worst:.3g} relative"


@pytest.mark.parametrize("regime", REGIMES)
def test_the_float64_reference_agrees_with_150_digit_arithmetic(regime):
    """The independent form used above, against mpmath, on one pair of each of a few draws (the
    smallest and the largest divergence of the draw)."""
    for seed in range(3):
        ups = draw(regime, seed)
        flat = [np.concatenate([u[key].double().numpy().ravel() for key in sorted(u)]) for u in ups]
        want = reference(ups, "client")
        off = np.argwhere(~np.eye(len(ups), dtype=bool))
        for s, t in (off[np.argmin(want[~np.eye(len(ups), dtype=bool)])],
                     off[np.argmax(want[~np.eye(len(ups), dtype=bool)])]):
            exact = mp_divergence(flat[s], flat[t])
            assert want[s, t] == pytest.approx(exact, rel=1e-9), (regime, seed, s, t)


def test_a_client_whose_mass_lies_where_the_reference_has_none_is_not_accepted_on_a_lost_denominator():
    """Around a reference with one entry far above the rest, a client without it has 1 + α ≈ e^{−gap}:
    the expansion's denominator is lost in rounding. Such a client is not expanded around that
    reference (its pairs go on to another reference), and every pair still comes out exact."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal(200) * 0.5
    ref = base.copy()
    ref[17] = 60.0  # e^{-60} ≈ 1e-26: far below float64's rounding of 1
    others = [base + rng.standard_normal(200) * 0.3 for _ in range(4)]
    ups = [{"w": torch.tensor(x, dtype=torch.float32)} for x in [ref] + others]
    blocks = dv.PackedBlocks(ups, ["w"])
    d, cond = dv.around_reference(blocks, list(range(5)), 0)
    assert torch.isnan(d[1:, 1:]).all()  # lost: not accepted around client 0
    got = dv.divergence_matrix(ups, 0.0, "client").numpy()
    assert _relative(got, reference(ups, "client")) <= 1e-9


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("fast,kernel", [(True, True), (True, False), (False, False)],
                         ids=["fast-kernel", "fast-torch", "precise"])
def test_every_pairs_error_is_within_its_own_bound_around_every_reference(regime, fast, kernel, monkeypatch):
    """Not only the pairs accepted: around each client as reference, every pair with a finite
    result has |d̂ − d| ≤ bound·|d̂| against the float64 form (itself within ~1e-12 here), on both
    passes (the fast one, exp and sums from which h and Q are taken off, through the C kernel where
    one can be built and through torch; the precise one, expm1)."""
    if not kernel:
        monkeypatch.setenv("FEDSWEEP_KERNELS", "0")
    checked = 0
    for seed in range(6):
        ups = draw(regime, seed)
        want = reference(ups, "client")
        k = len(ups)
        blocks = dv.PackedBlocks(ups, sorted(ups[0]), width=53)  # many blocks: the rescaling too
        for ref in range(k):
            d, bound = (t.numpy() for t in dv.around_reference(blocks, list(range(k)), ref, fast))
            for s in range(k):
                for t in range(s + 1, k):
                    if not (np.isfinite(d[s, t]) and np.isfinite(bound[s, t]) and d[s, t] != 0):
                        continue
                    err = abs(d[s, t] - want[s, t])
                    assert err <= bound[s, t] * abs(d[s, t]) + 1e-12 * abs(want[s, t]), \
                        (regime, seed, ref, s, t, err / abs(want[s, t]), bound[s, t])
                    checked += 1
    # widely spread clients: every expansion's 1 + α is lost (NaN), all go to the per-pair form
    assert checked > 0 or regime == "spread"


def _generic(k: int, n: int, scale: float, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(n, generator=g) * scale} for _ in range(k)]


def test_generic_clients_are_settled_by_the_fast_pass_and_near_identical_ones_are_not():
    """Independent clients (after local training, the common case) are all accepted by the fast
    pass around one reference; clients 1e-6 of the scale apart are not (its bound grows as 1/‖u‖),
    go on to the precise pass, and still come out within 1e-9 of the float64 form."""
    ups = _generic(8, 5000, 0.02, 0)
    stats = dv.Stats()
    got = dv.divergence_matrix(ups, 0.0, "client", stats=stats).numpy()
    assert stats.references == [0] and stats.fast == 28 and stats.per_pair == 0
    assert _relative(got, reference(ups, "client")) <= 1e-9
    base = _generic(1, 5000, 0.02, 1)[0]["w"]
    near = [{"w": base + 1e-8 * w["w"] / 0.02} for w in _generic(6, 5000, 0.02, 2)]
    stats = dv.Stats()
    got = dv.divergence_matrix(near, 0.0, "client", stats=stats).numpy()
    assert stats.fast == 0
    assert _relative(got, reference(near, "client")) <= 1e-9


def test_the_fast_and_precise_passes_agree_where_both_accept():
    ups = _generic(6, 3000, 0.5, 3)
    blocks = dv.PackedBlocks(ups, ["w"], width=257)
    fast_d, fast_b = dv.around_reference(blocks, list(range(6)), 2, True)
    slow_d, slow_b = dv.around_reference(blocks, list(range(6)), 2, False)
    both = (fast_b <= dv.TOLERANCE) & (slow_b <= dv.TOLERANCE)
    assert int(both.sum()) == 30
    assert torch.allclose(fast_d[both], slow_d[both], rtol=1e-12, atol=0.0)
