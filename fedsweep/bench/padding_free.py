"""The bare loop without padding: a step's sequences laid end to end into rows (``--padding-free``).

A measurement, not a training mode: ``fedsweep bench throughput --clients K --padding-free`` times the bare
transformers + peft loop a second time over the same sequences packed, to say on a GPU what a
padding-free forward would buy before the engine is given one (issue: the grouped step on a GPU; the
K = 50 step's rows carry 0.64 padded tokens per real token on the demo's data).

Packing: first-fit decreasing into rows of :data:`ROW_TOKENS` tokens (or the batch's own width where
that is more; no sequence is split), each sequence's positions counting from 0, so transformers sees
packed sequences (``masking_utils.find_packed_sequence_indices``; it looks only when neither an
attention mask nor a cache is passed) and masks attention block-diagonally. A row's unused tail is
one more "sequence" of padding, attended only by itself. Each sequence's first label is ignored, so
no token is predicted from the sequence before it; the loss (mean over the same supervised tokens) is
the padded batch's.

Why not rows of the batch's own width: the demo's sequences are mostly longer than half of it, so
such rows hold one sequence each and nothing is saved (measured on 2 cores, SmolLM2-135M K = 10:
40 rows in, 40 out). Why not one row of every token: through a mask, attention still computes every
masked pair, so its cost grows with the row's width; 512 tokens hold about five of the demo's
sequences.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsweep.engine.text import IGNORE

ROW_TOKENS = 512
"""Tokens per packed row (at least the batch's own width)."""


def first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
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


def pack_batch(batch: dict[str, torch.Tensor], pad_id: int, row_tokens: int = ROW_TOKENS) -> dict[str, torch.Tensor]:
    """A right-padded batch (``input_ids``, ``attention_mask``, ``labels``) as packed rows
    (``input_ids``, ``labels``, ``position_ids``) of ``row_tokens`` (at least the batch's width), on the
    batch's device."""
    ids = batch["input_ids"].cpu().numpy()
    labels = batch["labels"].cpu().numpy()
    lengths = batch["attention_mask"].sum(dim=1).cpu().tolist()
    width = max(ids.shape[1], row_tokens)
    layout = first_fit_decreasing(lengths, width)
    out_ids = np.full((len(layout), width), pad_id, dtype=np.int64)
    out_labels = np.full((len(layout), width), IGNORE, dtype=np.int64)
    positions = np.zeros((len(layout), width), dtype=np.int64)
    for r, members in enumerate(layout):
        at = 0
        for i in members:
            n = lengths[i]
            out_ids[r, at:at + n] = ids[i, :n]  # (a row of the batch is right-padded: its tokens come first)
            out_labels[r, at + 1:at + n] = labels[i, 1:n]  # the first token is predicted by no one
            positions[r, at:at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(width - at)  # the tail: a sequence of its own
    device = batch["input_ids"].device
    return {"input_ids": torch.from_numpy(out_ids).to(device), "labels": torch.from_numpy(out_labels).to(device),
            "position_ids": torch.from_numpy(positions).to(device)}


def cells(batches: list[dict[str, torch.Tensor]]) -> int:
    """Token cells the forwards of ``batches`` compute (rows × width, summed)."""
    return int(sum(b["input_ids"].numel() for b in batches))
