"""DRIFT's flat layouts: an adapter's tensors laid end to end — by shape group for the dense
accelerator path (:func:`layout`, :func:`flatten`), cut into column blocks for the blocked CPU path and
its C kernel (:func:`pack_layout`) — and the summation constant of the divergences' error bound.

Shared by ``divergence`` (the divergences), ``fused`` (the C kernels) and ``graph`` (the mix), which
import it and not each other's internals: no module of the method imports back up.
"""

from __future__ import annotations

import math

from fedsweep.lazy import torch


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


def key_spans(lay: list[tuple[tuple[int, ...], list[str]]]):
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


def use_dense(t: torch.Tensor, dense: bool | None) -> bool:
    """The whole-matrix path where asked, else on any device but the CPU (where the blocked,
    cache-sized path is faster and needs no K × n copies)."""
    return t.device.type != "cpu" if dense is None else dense


def pack_layout(sizes: list[int], width: int) -> list[tuple[list[tuple[int, int, int, int]], int]]:
    """Tensors of ``sizes`` entries, concatenated, cut into blocks of ``width`` columns: each block's
    pieces (tensor, start, length, column) and its width."""
    layout, pieces, fill = [], [], 0
    for j, size in enumerate(sizes):
        start = 0
        while start < size:
            m = min(width - fill, size - start)
            pieces.append((j, start, m, fill))
            fill += m
            start += m
            if fill == width:
                layout.append((pieces, fill))
                pieces, fill = [], 0
    if fill:
        layout.append((pieces, fill))
    return layout


def summation_constant(width: int, blocks: int) -> float:
    """c with every float64 sum of :func:`around_reference` off by at most c·ε·Σ|terms|: a block's
    product sums ``width`` terms (γ_width, the worst case of any summation order), the blocks'
    results are added in sequence (γ_blocks), and the rescales by the running maximum, the
    division by Q(1 + α) and the four-term combination of d add a few ε more."""
    return float(width + blocks + 16)
