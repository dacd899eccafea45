"""The bare loop without padding: a step's sequences laid end to end into rows (``--padding-free``).

``fedsweep bench throughput --clients K --padding-free`` times the bare transformers + peft loop a
second time over the same sequences packed: the careful user's loop the engine is measured against
(the engine packs its own rows with ``train.pack_tokens``, ``engine.packing``; the K = 50 step's rows
carry 0.64 padded tokens per real token on the demo's data).

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

from fedsweep.engine.packing import first_fit_decreasing
from fedsweep.engine.text import IGNORE

ROW_TOKENS = 512
"""Tokens per packed row (at least the batch's own width)."""


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
