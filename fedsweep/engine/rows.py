"""How a step's rows are laid out into forwards: by length, so that no row pays for another's.

A forward computes a rectangle: every row right-padded to the widest. Clients of a group have
different prompt and answer lengths, so one forward over all their batches pads short rows to the
longest client's length (SmolLM2-135M at K = 10 spent most of a lockstep step on padding).
Here a step's *units* — the rows that must share a forward and a backward (an SFT example is one
row; a DPO pair is two, chosen and rejected, since the pair's loss is not linear in them) — are
sorted by width and cut into buckets, greedily, so that each bucket's padded tokens (rows × width −
real tokens) stay within ``max_padding`` of its real tokens (a lone unit's own padding — a DPO
pair's two lengths — is allowed). Right padding and causal attention make a row's loss independent
of the rows beside it, so the layout changes the rounding, not the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_PADDING = 0.15
"""Padded tokens allowed per bucket, as a share of its real tokens."""


@dataclass(frozen=True)
class Shape:
    """A unit's rows and the tokens of each."""

    lengths: tuple[int, ...]

    @property
    def width(self) -> int:
        return max(self.lengths)

    @property
    def real(self) -> int:
        return sum(self.lengths)


def buckets(shapes: list[Shape], max_padding: float = MAX_PADDING, max_rows: int | None = None,
            min_rows: int = 1) -> list[list[int]]:
    """Indices of ``shapes`` cut into forwards: sorted by width (ties in the order given), each bucket
    grown while its padding stays within ``max_padding`` of its real tokens, or while it has fewer
    than ``min_rows`` rows (a forward has a fixed cost: one client's batch is not cut), and its rows
    within ``max_rows``."""
    order = sorted(range(len(shapes)), key=lambda i: shapes[i].width)
    out: list[list[int]] = []
    rows = real = 0
    for i in order:
        s = shapes[i]
        if out:
            n, r = rows + len(s.lengths), real + s.real
            if (n * s.width - r <= max_padding * r or rows < min_rows) and (max_rows is None or n <= max_rows):
                out[-1].append(i)
                rows, real = n, r
                continue
        out.append([i])
        rows, real = len(s.lengths), s.real
    return out


def padding(shapes: list[Shape], layout: list[list[int]]) -> tuple[int, int]:
    """(real tokens, padded tokens) of ``shapes`` computed in the forwards of ``layout``."""
    real = padded = 0
    for bucket in layout:
        width = max(shapes[i].width for i in bucket)
        rows = sum(len(shapes[i].lengths) for i in bucket)
        r = sum(shapes[i].real for i in bucket)
        real, padded = real + r, padded + rows * width - r
    return real, padded


def chunks(items: list, size: int) -> list[list]:
    """``items`` in consecutive chunks of at most ``size``."""
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


def training_groups(items: list[tuple[int, int]], payloads: tuple, size: int) -> list[list[tuple[int, Any]]]:
    """``items`` (client, payload index) as the engine's groups: by base version, at most ``size``
    clients; a payload with DP-SGD trains alone (``plan.batching.why_alone`` says so from the
    config; a payload can still carry it)."""
    together: dict[Any, list[tuple[int, Any]]] = {}
    alone = []
    for cid, which in items:
        payload = payloads[which]
        if size > 1 and payload.dp is None:
            together.setdefault(payload.base_version, []).append((cid, payload))
        else:
            alone.append([(cid, payload)])
    return [chunk for group in together.values() for chunk in chunks(group, size)] + alone
