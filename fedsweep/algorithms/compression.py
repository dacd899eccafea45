"""Compressed uploads (``clients.upload.compression``): what a client sends of its update
Δ = θ − θ_start, and how the server reads it back. Pure tensor code.

* ``fp16`` / ``bf16`` — each entry as a 16-bit float: 2 bytes an entry.
* ``int8`` — blockwise symmetric int8 (as NVFlare's and bitsandbytes' blockwise quantisation): the
  flattened tensor in blocks of ``block_size`` entries, each block scaled by s = max|x|/127 and
  rounded, q = round(x/s) ∈ [−127, 127]; read back as q·s. 1 byte an entry and a float32 scale per
  block (a block of zeros has s = 0 and reads back as zeros).
* ``topk`` — top-k sparsification with error feedback (Stich et al. 2018, "Sparsified SGD with
  Memory"; Seide et al. 2014's error feedback): the client adds its residual to the update, sends the
  k = ⌈ρ n⌉ entries of largest magnitude (ties: the lower index) as float32 values and int32 indices
  (8 bytes an entry), and keeps what it did not send as its next residual.

The bytes are those of the tensors actually sent. The update is relative to the start the server
knows (the payload's parameters), so the server adds it back: θ̂ = θ_start + decode(sent).
"""

from __future__ import annotations

import math

from fedsweep.algorithms.tensors import Params
from fedsweep.lazy import torch

KINDS = ("none", "fp16", "bf16", "int8", "topk")
SENT, SHAPE = "upload/sent/", "upload/shape/"
"""Keys of a compressed upload's tensors: what was sent of each parameter, and the parameter's shape."""
RESIDUAL = "upload/residual/"
"""Key prefix of a client's topk residual in its per-client state (checkpointed with it)."""


def compress(delta: Params, kind: str, block_size: int = 64, fraction: float = 0.01,
             residual: Params | None = None) -> tuple[Params, int, Params | None]:
    """(tensors to send, their bytes, the new residual — topk only) for the update ``delta``."""
    sent, nbytes = {}, 0
    new_residual = {} if kind == "topk" else None
    for key in sorted(delta):
        x = delta[key].detach().float()
        if kind in ("fp16", "bf16"):
            t = x.to(torch.float16 if kind == "fp16" else torch.bfloat16)
            sent[key] = t
            nbytes += t.numel() * 2
        elif kind == "int8":
            q, scales = int8_blocks(x.reshape(-1), block_size)
            sent[key + "#q"], sent[key + "#s"] = q, scales
            nbytes += q.numel() + scales.numel() * 4
        elif kind == "topk":
            full = x.reshape(-1) + (residual[key].reshape(-1).float() if residual and key in residual else 0.0)
            idx, values = top_k(full, max(1, math.ceil(fraction * full.numel())))
            sent[key + "#i"], sent[key + "#v"] = idx, values
            rest = full.clone()
            rest[idx.long()] = 0.0
            new_residual[key] = rest.reshape(x.shape)
            nbytes += idx.numel() * 4 + values.numel() * 4
        else:
            raise ValueError(f"clients.upload.compression: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    return sent, nbytes, new_residual


def decompress(sent: Params, shapes: dict[str, tuple[int, ...]], kind: str, block_size: int = 64) -> Params:
    """The update the server reads back from what ``compress`` sent, float32, in ``shapes``."""
    out = {}
    for key, shape in shapes.items():
        n = math.prod(shape)
        if kind in ("fp16", "bf16"):
            out[key] = sent[key].float().reshape(shape)
        elif kind == "int8":
            out[key] = int8_read(sent[key + "#q"], sent[key + "#s"], block_size)[:n].reshape(shape)
        elif kind == "topk":
            flat = torch.zeros(n, dtype=torch.float32)
            flat[sent[key + "#i"].long()] = sent[key + "#v"].float()
            out[key] = flat.reshape(shape)
        else:
            raise ValueError(f"clients.upload.compression: unknown kind {kind!r}")
    return out


def received(tensors: Params, kind: str, block_size: int = 64) -> Params | None:
    """The update a compressed upload carries (``SENT``/``SHAPE`` tensors), or None if it carries none."""
    shapes = {k[len(SHAPE):]: tuple(int(n) for n in v.tolist()) for k, v in tensors.items() if k.startswith(SHAPE)}
    if not shapes:
        return None
    sent = {k[len(SENT):]: v for k, v in tensors.items() if k.startswith(SENT)}
    return decompress(sent, shapes, kind, block_size)


def int8_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric int8 of a flat float tensor: (int8 codes, float32 scale per block)."""
    n = x.numel()
    pad = (-n) % block_size
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).reshape(-1, block_size)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n].clone(), scales


def int8_read(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    n = q.numel()
    pad = (-n) % block_size
    blocks = torch.nn.functional.pad(q.float(), (0, pad)).reshape(-1, block_size)
    return (blocks * scales[:, None]).reshape(-1)[:n]


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude of a flat tensor, ties to the lower index: (int32 indices in
    increasing order, their float32 values)."""
    order = torch.argsort(x.abs(), descending=True, stable=True)[:k]  # stable: equal magnitudes keep index order
    idx = order.sort().values
    return idx.to(torch.int32), x[idx].float()
