"""Padding-free rows: a client's sequences laid end to end (``train.pack_tokens``).

A right-padded forward computes rows × width token cells; its padding computes as much as real
tokens. Packed, each row holds several of one client's sequences back to back, each sequence's
positions counting from 0 again, and no attention mask is passed: transformers then finds the
sequences from the positions (``masking_utils.find_packed_sequence_indices``) and keeps attention
within each one (a block-diagonal causal mask). A row's unused tail is one more "sequence" of
padding tokens that only attends to itself and is never scored. A row holds one client's sequences
only, as a row computes with one client's adapter (``Binding.rows``).

Layout: first-fit decreasing into rows of ``width`` tokens (no sequence is split): at most
``train.pack_tokens``, and no more than the owner with the most tokens needs (:func:`row_width`).
The loss of a sequence is the padded row's: the same tokens predict the same supervised targets
through the same causal context, so packing changes the rounding (other matrix shapes), not the
result.

Measured on 2 CPU cores (tiny model, K = 4, ``bench throughput --padding-free``): packed rows train at
0.62× the by-length padded layout the CPU uses (its buckets already keep padding within 15 %, and
attention computes every masked pair of a packed row), so the setting is off by default; its GPU
default waits for ``make gpu-check`` (the ``grouped_packed`` row, against ``train.forwards: one``).
"""

from __future__ import annotations

from collections.abc import Sequence


def first_fit_decreasing(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``width`` tokens: longest first, each into the first row
    with room (ties in the order given)."""
    if lengths and max(lengths) > width:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit rows of {width}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def row_width(lengths: Sequence[int], owners: Sequence[int], pack_tokens: int) -> int:
    """The packed rows' width: the most tokens one owner has (each owner's sequences then fill one row),
    capped at ``pack_tokens``, and never less than the longest sequence. Every row of a forward has the
    width, so a wider row than an owner needs is padding."""
    totals: dict[int, int] = {}
    for n, owner in zip(lengths, owners):
        totals[owner] = totals.get(owner, 0) + n
    return max(min(pack_tokens, max(totals.values(), default=1)), max(lengths, default=1))


def pack_by_owner(lengths: Sequence[int], owners: Sequence[int], width: int) -> list[tuple[int, list[int]]]:
    """(owner, indices of ``lengths``) per packed row: each owner's sequences first-fit decreasing into
    rows of ``width`` tokens, owners in order of first appearance."""
    by_owner: dict[int, list[int]] = {}
    for i, owner in enumerate(owners):
        by_owner.setdefault(owner, []).append(i)
    out = []
    for owner, members in by_owner.items():
        for row in first_fit_decreasing([lengths[i] for i in members], width):
            out.append((owner, [members[j] for j in row]))
    return out
