"""DRIFT's two C kernels, each with its torch path as the fallback.

``block_sums``: the fast divergence pass through ``fedsweep/kernels/drift_fast.c`` — the same sums
as ``divergence.block_sums(fast=True)`` (Σ w e_s u_t, Σ w e_s, h, Q and the extremes of u) with one
read of each float32 entry instead of a torch operation per step, the blocks split over threads.
w is taken against the maximum of x_R over the whole adapter (found first) rather than a running
one, so nothing is rescaled; the kernel's exp is a degree-13 polynomial within 2 ulp, which the
bound's η (module docstring of ``divergence``) covers many times over. None where the kernel
cannot be built or a block holds entries more than 700 apart (the torch pass then runs).

``mix``: eq. 14 through ``fedsweep/kernels/drift_mix.c``, every client's θ_k over column chunks so
each upload is read from memory once, the tensors split over threads; False where it cannot run
(no kernel, or not all float32 on the CPU), and ``graph.mix`` takes its torch path.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fedsweep import kernels
from fedsweep.algorithms.drift.layout import pack_layout, summation_constant
from fedsweep.lazy import torch

_P = ctypes.c_void_p
WIDTH = 1 << 12  # columns per block: a block's u and e (2 × 16 rows × 32 KiB) stay in a core's L2 for its product


def _kernel():
    return kernels.function("drift_fast", "drift_fast_blocks", ctypes.c_int,
                            [ctypes.c_int] * 5 + [_P] * 8 + [ctypes.c_int, ctypes.c_double, _P, _P, ctypes.c_int64]
                            + [_P] * 8)


def _ranges(weights, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges [lo, hi) of the indices of ``weights``, of about equal totals."""
    total = np.concatenate([[0], np.cumsum(weights)])
    cuts = [0] + [int(np.searchsorted(total, total[-1] * i / parts)) for i in range(1, parts)] + [len(weights)]
    return list(zip(cuts[:-1], cuts[1:]))


def _on_threads(fn, ranges: list[tuple[int, int]]) -> list:
    """fn(lo, hi) for each range, each on a thread of its own (the kernels release the GIL)."""
    with ThreadPoolExecutor(len(ranges)) as pool:
        return list(pool.map(lambda r: fn(*r), ranges))


class Plan:
    """A ``PackedBlocks`` layout as flat arrays for the kernel, and the tensors' addresses."""

    def __init__(self, blocks) -> None:
        layout = pack_layout([t.numel() for t in blocks.flats[0]], min(WIDTH, blocks.width))
        pieces = [p for block, _ in layout for p in block]
        self.tensor = np.asarray([p[0] for p in pieces], dtype=np.int32)
        self.start = np.asarray([p[1] for p in pieces], dtype=np.int64)
        self.length = np.asarray([p[2] for p in pieces], dtype=np.int32)
        self.fill = np.asarray([p[3] for p in pieces], dtype=np.int32)
        counts = [len(block) for block, _ in layout]
        self.offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.counts = np.asarray(counts, dtype=np.int32)
        self.widths = np.asarray([w for _, w in layout], dtype=np.int32)
        self.base = np.asarray([[t.data_ptr() for t in f] for f in blocks.flats], dtype=np.int64)


def block_sums(blocks, rows: list[int], ref: int):
    """(H_raw, Σ w e_s, h, Q, max u_s, min u_s, c) of ``divergence.block_sums`` with ``fast=True``,
    or None (module docstring); c counts this pass's blocks, and one summation per thread."""
    f = _kernel()
    if f is None:
        return None
    if blocks.kernel_plan is None:
        blocks.kernel_plan = Plan(blocks)
    plan = blocks.kernel_plan
    k, width, n_tensors = len(rows), int(plan.widths.max()), plan.base.shape[1]
    kp = (k + 3) // 4 * 4  # the product's 4 × 4 tiles: rows past k stay zero
    base = np.ascontiguousarray(plan.base[rows])
    m_ref = max(float(t.max()) for t in blocks.flats[rows[ref]] if t.numel())
    n_blocks = len(plan.widths)
    threads = max(1, min(torch.get_num_threads(), n_blocks))
    shared = [plan.offsets.ctypes.data, plan.counts.ctypes.data, plan.widths.ctypes.data, plan.tensor.ctypes.data,
              plan.start.ctypes.data, plan.length.ctypes.data, plan.fill.ctypes.data, base.ctypes.data]

    def work(lo: int, hi: int):
        u, e = np.zeros((kp, width)), np.zeros((kp, width))
        w, xr = np.empty(width), np.empty(width)
        hh = np.zeros((kp, kp))
        umax, umin = np.full(k, -np.inf), np.full(k, np.inf)
        se, h, q = np.zeros(k), np.zeros(k), np.zeros(1)
        bad = f(k, kp, ref, lo, hi, *shared, n_tensors, m_ref, u.ctypes.data, e.ctypes.data, width,
                *(a.ctypes.data for a in (w, xr, umax, umin, se, h, q, hh)))
        return None if bad else (hh[:k, :k], se, h, q, umax, umin)

    parts = _on_threads(work, _ranges(plan.widths, threads))
    if any(p is None for p in parts):
        return None
    hh, se, h, q = (torch.from_numpy(sum(p[i] for p in parts)) for i in range(4))
    umax = torch.from_numpy(np.max([p[4] for p in parts], axis=0))
    umin = torch.from_numpy(np.min([p[5] for p in parts], axis=0))
    return hh, se, h, q[0], umax, umin, summation_constant(width, n_blocks + threads)


def mix(uploads: list[dict], terms: list[list[tuple[int, float]]], outputs: list[dict], keys: list[str]) -> bool:
    """outputs[k][key] ← Σ_(j, w) in terms[k] w · uploads[j][key] for every key (module docstring);
    False, touching nothing, where the kernel cannot run."""
    tensors = [u[key] for u in uploads for key in keys] + [o[key] for o in outputs for key in keys]
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return False
    f = kernels.function("drift_mix", "drift_mix", None,
                         [ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int])
    if f is None:
        return False
    offsets = np.asarray([0] + list(np.cumsum([len(t) for t in terms])), dtype=np.int32)
    index = np.asarray([j for t in terms for j, _ in t], dtype=np.int32)
    weight = np.asarray([w for t in terms for _, w in t], dtype=np.float64)
    src = np.asarray([[u[key].data_ptr() for u in uploads] for key in keys], dtype=np.int64)
    dst = np.asarray([[o[key].data_ptr() for o in outputs] for key in keys], dtype=np.int64)
    size = np.asarray([uploads[0][key].numel() for key in keys], dtype=np.int64)
    args = (len(outputs), len(uploads), offsets.ctypes.data, index.ctypes.data, weight.ctypes.data,
            src.ctypes.data, dst.ctypes.data, size.ctypes.data)
    _on_threads(lambda lo, hi: f(*args, lo, hi), _ranges(size, max(1, min(torch.get_num_threads(), len(keys)))))
    return True
