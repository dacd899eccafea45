"""DRIFT's fast pass through the C kernel (``fedsweep/kernels/drift_fast.c``, loaded by
``fedsweep.kernels``): its exp against float64 exp, its sums against the torch pass, the fallbacks
(entries too far apart, no compiler), and the divergences with and without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep import kernels
from fedsweep.algorithms.drift import divergence as dv
from fedsweep.algorithms.drift import fused
from fedsweep.algorithms.drift import graph as dg

needs_kernel = pytest.mark.skipif(kernels.load("drift_fast") is None,
                                  reason=f"no C kernel here: {kernels.why_not('drift_fast')}")


def _clients(k: int, n: int, scale: float, seed: int, offset: float = 0.0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(n // 3, generator=g) * scale + offset, "b": torch.randn(n - n // 3, generator=g) * scale}
            for _ in range(k)]


@needs_kernel
def test_the_kernels_exp_is_within_two_ulp_of_float64_exp():
    """Around a reference of zeros with its maximum 0, the kernel's e is exp(x) itself: over 200,000
    float32 values spread over [−700, 700], clustered near 0 and tiny, within 2 ulp (relative 2^-51)
    of numpy's float64 exp (itself within 1 ulp)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-700, 700, 100_000), rng.normal(0, 1e-3, 50_000),
                        rng.normal(0, 1.0, 49_990), [0.0, 1e-30, -1e-30, 1e-8, -1e-8, 699.9, -699.9, 0.5, -0.5, 1.0]])
    x = x.astype(np.float32)
    ups = [{"w": torch.zeros(len(x))}, {"w": torch.from_numpy(x)}]
    ups[0]["w"][0] = 0.0
    blocks = dv.PackedBlocks(ups, ["w"], width=len(x))
    f, plan = fused._kernel(), fused.Plan(blocks)
    width = int(plan.widths.max())
    u, e = np.zeros((4, width)), np.zeros((4, width))
    w, xr, hh = np.empty(width), np.empty(width), np.zeros((4, 4))
    stats = [np.full(2, -np.inf), np.full(2, np.inf), np.zeros(2), np.zeros(2), np.zeros(1)]
    base = np.ascontiguousarray(plan.base)
    shared = [a.ctypes.data for a in (plan.offsets, plan.counts, plan.widths, plan.tensor, plan.start, plan.length,
                                      plan.fill, base)]
    got_e, got_u = [], []
    for blk in range(len(plan.widths)):  # one block a call, to read each block's e and u
        assert f(2, 4, 0, blk, blk + 1, *shared, 1, 0.0, u.ctypes.data, e.ctypes.data, width,
                 *(a.ctypes.data for a in (w, xr, *stats, hh))) == 0
        got_e.append(e[1, :plan.widths[blk]].copy())
        got_u.append(u[1, :plan.widths[blk]].copy())
    e1, u1 = np.concatenate(got_e), np.concatenate(got_u)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(e1 - want) / want
    assert rel.max() <= 2 * 2.0 ** -52, f"worst {rel.max() / 2.0 ** -52:.2f} ulp at x = {x[rel.argmax()]}"
    assert np.array_equal(u1, x.astype(np.float64))  # u = x − x_R, exact


@needs_kernel
@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_the_kernels_sums_equal_the_torch_pass(offset):
    """Σ w e_s u_t, Σ w e_s, h, Q and the extremes of u, block by block over a layout that cuts
    tensors (width 97), on 3 threads: the torch pass's to 1e-12 (the extremes exactly)."""
    ups = _clients(7, 5000, 0.3, 1, offset)
    blocks = dv.PackedBlocks(ups, ["a", "b"], width=97)
    torch.set_num_threads(3)
    try:
        got = fused.block_sums(blocks, [0, 2, 3, 5, 6], 2)
    finally:
        torch.set_num_threads(2)
    want = dv.block_sums(blocks, [0, 2, 3, 5, 6], 2, True)
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-12, atol=0)
    assert torch.equal(got[4], want[4]) and torch.equal(got[5], want[5])
    blocks_read = -(-5000 // 97)  # both passes read the same blocks (narrower than the kernel's own)
    assert want[6] == dv.summation_constant(97, blocks_read)
    assert got[6] == dv.summation_constant(97, blocks_read + 3)  # one summation more per thread


@needs_kernel
def test_divergences_with_and_without_the_kernel_agree(monkeypatch):
    for k, scale, offset, seed in [(9, 0.02, 0.0, 2), (5, 1.0, 2.0, 3), (6, 30.0, 0.0, 4)]:
        ups = _clients(k, 3000, scale, seed, offset)
        stats, off = dv.Stats(), dv.Stats()
        with_kernel = dv.divergence_matrix(ups, 0.0, stats=stats)
        monkeypatch.setenv("FEDSWEEP_KERNELS", "0")
        without = dv.divergence_matrix(ups, 0.0, stats=off)
        monkeypatch.delenv("FEDSWEEP_KERNELS")
        assert stats.kernel_passes >= 1 and off.kernel_passes == 0
        torch.testing.assert_close(with_kernel, without, rtol=1e-11, atol=0)


@needs_kernel
def test_entries_more_than_700_apart_fall_back_to_the_torch_pass():
    ups = _clients(4, 600, 1.0, 5)
    ups[2]["a"][7] = 800.0
    blocks = dv.PackedBlocks(ups, ["a", "b"], width=64)
    assert fused.block_sums(blocks, list(range(4)), 0) is None
    assert fused.block_sums(blocks, list(range(4)), 2) is None  # w of the far entries underflows
    want = np.array([[dv.pair_divergence(torch.cat([ups[s]["a"], ups[s]["b"]]), torch.cat([ups[t]["a"], ups[t]["b"]]))
                      for t in range(4)] for s in range(4)])
    got = dv.divergence_matrix(ups, 0.0).numpy()
    off = ~np.eye(4, dtype=bool)
    assert np.max(np.abs(got - want)[off] / want[off]) <= 1e-9


def test_without_a_compiler_the_torch_pass_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("FEDSWEEP_CACHE", str(tmp_path / "cache"))
    kernels.forget()
    try:
        assert kernels.load("drift_fast") is None
        assert "no C compiler" in kernels.why_not("drift_fast")
        ups = _clients(5, 900, 0.1, 6)
        assert fused.block_sums(dv.PackedBlocks(ups, ["a", "b"]), list(range(5)), 0) is None
        stats = dv.Stats()
        got = dv.divergence_matrix(ups, 0.0, stats=stats).numpy()
        assert stats.fast == 10
        want = np.array([[dv.pair_divergence(torch.cat([ups[s]["a"], ups[s]["b"]]), torch.cat([ups[t]["a"], ups[t]["b"]]))
                          for t in range(5)] for s in range(5)])
        off = ~np.eye(5, dtype=bool)
        assert np.max(np.abs(got - want)[off] / want[off]) <= 1e-9
    finally:
        kernels.forget()


def test_a_kernel_is_built_once_and_found_again(monkeypatch, tmp_path):
    """Built into the cache folder under a name keyed by source, flags and CPU; a second process
    (here: after forgetting) loads the same file without building."""
    monkeypatch.setenv("FEDSWEEP_CACHE", str(tmp_path))
    kernels.forget()
    try:
        if kernels.load("drift_fast") is None:
            pytest.skip(f"no C kernel here: {kernels.why_not('drift_fast')}")
        built = list((tmp_path / "kernels").glob("drift_fast-*.so"))  # in fedsweep's cache, beside the models
        assert len(built) == 1 and len(list((tmp_path / "kernels").iterdir())) == 1
        stamp = built[0].stat().st_mtime_ns
        kernels.forget()
        assert kernels.load("drift_fast") is not None and built[0].stat().st_mtime_ns == stamp
    finally:
        kernels.forget()


def _mix_case(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    shapes = {"a": (7,), "b": (33, 3), "c": (1000,), "d": (4, 16)}  # views at unaligned offsets, short tails
    ups = [{n: (torch.randn(s, generator=g) * 10.0 ** (i % 3 - 1)).to(dtype) for n, s in shapes.items()} for i in range(6)]
    terms = [[(0, 1.0)], [(1, 0.3), (4, 0.7)], [(2, 0.2), (0, 0.5), (5, 0.3)], [(3, 0.25), (1, 0.25), (2, 0.25), (5, 0.25)]]
    size = sum(torch.Size(s).numel() for s in shapes.values())
    bufs = [torch.full((size,), float("nan"), dtype=dtype) for _ in terms]
    outs = [{n: v.view(shapes[n]) for n, v in zip(shapes, torch.split(b, [torch.Size(s).numel() for s in shapes.values()]))}
            for b in bufs]
    return ups, terms, outs, list(shapes)


@pytest.mark.skipif(kernels.load("drift_mix") is None, reason="no C kernel here")
def test_the_mix_kernel_rounds_the_float64_weighted_sum_once():
    """Every output entry is the float64 Σ w_j x_j rounded to float32 (within half an ulp of it), also
    at unaligned offsets and in short tails; the torch path (a lerp per term) is within a few ulp
    of the inputs' scale of it."""
    ups, terms, outs, keys = _mix_case()
    assert fused.mix(ups, terms, outs, keys)
    for out, t in zip(outs, terms):
        for key in keys:
            want = sum(w * ups[j][key].double() for j, w in t)
            assert torch.equal(out[key], want.float()) or \
                float(((out[key].double() - want).abs() / want.abs().clamp_min(1e-30)).max()) <= 2.0 ** -24
    _, _, torch_outs, _ = _mix_case()
    for out, t in zip(torch_outs, terms):
        for key in keys:
            dg.running_mean(out[key], [ups[j][key] for j, _ in t], [w for _, w in t])
    for a, b, t in zip(outs, torch_outs, terms):
        for key in keys:  # lerp rounds relative to its inputs, which may cancel
            scale = max(float(ups[j][key].abs().max()) for j, _ in t)
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=4 * 2.0 ** -23 * scale)


def test_the_mix_kernel_declines_what_is_not_float32():
    ups, terms, outs, keys = _mix_case(torch.float64)
    assert fused.mix(ups, terms, outs, keys) is False
    assert all(torch.isnan(o[k]).all() for o in outs for k in keys)  # untouched


def test_the_kernel_switch_reaches_the_actors(monkeypatch):
    """FEDSWEEP_KERNELS, where set, is in the environment Ray actors and jobs get (a cluster's server
    actor would otherwise build and use the kernels the user turned off); unset, nothing is added."""
    from fedsweep.env import worker_env

    monkeypatch.delenv("FEDSWEEP_KERNELS", raising=False)
    assert "FEDSWEEP_KERNELS" not in worker_env()
    monkeypatch.setenv("FEDSWEEP_KERNELS", "0")
    assert worker_env()["FEDSWEEP_KERNELS"] == "0"
