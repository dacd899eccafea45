"""Padding-free rows: a client's sequences laid end to end (``train.pack_tokens``).

A right-padded forward computes rows × width token cells; its padding computes as much as real
tokens. Packed, each row holds several of one client's sequences back to back, each sequence's
positions counting from 0 again, and no attention mask is passed: transformers then finds the
sequences from the positions (``masking_utils.find_packed_sequence_indices``) and keeps attention
within each one (a block-diagonal causal mask). A row's unused tail is one more "sequence" of
padding tokens that only attends to itself and is never scored. A row holds one client's sequences
only, as a row computes with one client's adapter (``Binding.rows``).

Layout: first-fit decreasing into rows of ``width`` tokens (no sequence is split), the width chosen
up to ``train.pack_tokens`` to compute the fewest cells (:func:`packed_rows`).
The loss of a sequence is the padded row's: the same tokens predict the same supervised targets
through the same causal context, so packing changes the rounding (other matrix shapes), not the
result.

A step's packed rows are one forward (there is no padding left for ``train.forwards: by_length`` to
cut away). Measured on 2 CPU cores (tiny model, the demo's rows, K = 4, ``bench throughput
--padding-free``, on cores shared with a card's run): 2,717 padding tokens a round against 5,494 for
one padded forward a step, training at 0.88× the by-length layout the CPU uses (its buckets keep
padding within 15 %, 1,178 tokens, and attention computes every masked pair of a packed row), so the
setting is off by default; its GPU default waits for ``make gpu-check`` (the ``grouped_packed`` row).
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


def packed_rows(lengths: Sequence[int], owners: Sequence[int], pack_tokens: int) -> tuple[int, list[tuple[int, list[int]]]]:
    """The packed rows' width and layout (:func:`pack_by_owner`): of the widths from the longest sequence
    up to ``pack_tokens`` that could matter (the longest, the cap, each owner's total and its halves and
    thirds), the one whose layout computes the fewest token cells, the narrower on a tie. Every row of a
    forward has the width and a row holds one owner's sequences, so a width fitted to one owner pads
    another's rows (on the demo's rows one fixed width padded more than one padded forward a step)."""
    longest = max(lengths, default=1)
    cap = max(pack_tokens, longest)
    totals: dict[int, int] = {}
    for n, owner in zip(lengths, owners):
        totals[owner] = totals.get(owner, 0) + n
    candidates = {longest, cap} | {min(cap, max(longest, -(-t // k))) for t in totals.values() for k in (1, 2, 3)}
    layouts = [(w, pack_by_owner(lengths, owners, w)) for w in sorted(candidates)]
    return min(layouts, key=lambda wl: len(wl[1]) * wl[0])


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
