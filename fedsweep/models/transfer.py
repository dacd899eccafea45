"""Host-to-device copies that do not make the host wait.

A copy from pageable host memory to a GPU holds the host until the stream has run everything queued
before it: once per forward (the collated batch, the scored positions, the rows' owners, AdamW's
step sizes) that drains the GPU's queue, and the next kernels start from an idle card. From pinned
memory the copy is queued like a kernel and the host goes on (PyTorch's caching host allocator keeps
a pinned block until the copies that read it have run). On any other device these are plain ``.to``.
"""

from __future__ import annotations

from typing import Any

from fedsweep.lazy import torch


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host tensor onto ``device``: through pinned memory without a wait to a GPU, else ``.to``."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors (a batch, its scored positions) onto ``device`` (:func:`_move`; the host tensors may
    change as soon as this returns)."""
    return {k: _move(v, device) for k, v in tensors.items()}


def tensor_on(values: list[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host wait on a GPU."""
    return _move(torch.tensor(values, dtype=dtype), device)
