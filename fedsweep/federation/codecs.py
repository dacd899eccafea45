"""Codecs for what travels between server and clients (``clients.upload`` and ``server.download``).

A codec encodes an update Δ (a dict of tensors) into an :class:`Encoded` message, counts the bytes of
what it sends, decodes a message back to float32 tensors, and owns its error-feedback residual where
it has one. Each codec is an object; :data:`CODECS` is the one registry (its keys are the config's
``compression`` values). Pure tensor code.

* ``none`` — Δ as it is (float32): nothing encoded.
* ``fp16`` / ``bf16`` — each entry as a 16-bit float: 2 bytes an entry.
* ``int8`` — blockwise symmetric int8 (as NVFlare's and bitsandbytes' blockwise quantisation): the
  flattened tensor in blocks of ``block_size`` entries, each block scaled by s = max|x|/127 and
  rounded, q = round(x/s) ∈ [−127, 127]; read back as q·s. 1 byte an entry and a float32 scale per
  block (a block of zeros has s = 0 and reads back as zeros).
* ``topk`` — top-k sparsification with error feedback (Stich et al. 2018, "Sparsified SGD with
  Memory"; Seide et al. 2014's error feedback): the residual e is added to the update, the
  k = ⌈ρ n⌉ entries of largest magnitude of Δ + e are sent (ties: the lower index) as float32 values
  and int32 indices (8 bytes an entry), and e ← (Δ + e) − sent.

The bytes are those of the tensors actually sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

from fedsweep.algorithms.tensors import Params
from fedsweep.lazy import torch


@dataclass
class Encoded:
    """One encoded update: for each tensor, its shape and the named parts the codec sent."""

    codec: str
    shapes: dict[str, tuple[int, ...]]
    parts: dict[str, dict[str, torch.Tensor]]
    nbytes: int


@dataclass
class Codec:
    """Base class: ``name`` is the registry key; subclasses give ``encode_one`` and ``decode_one``, and
    :meth:`of` where they read settings of the config section."""

    name: ClassVar[str] = ""
    has_residual: ClassVar[bool] = False
    """Whether the codec keeps what it did not send (error feedback) for the next message."""

    @classmethod
    def of(cls, section) -> "Codec":
        """This codec with the settings of ``section`` (``clients.upload`` or ``server.download``)."""
        return cls()

    def encode(self, delta: Params, residual: Params | None = None) -> tuple[Encoded, Params | None]:
        """(the message for ``delta``, the new residual: None for codecs without one)."""
        shapes, parts, nbytes, kept = {}, {}, 0, ({} if self.has_residual else None)
        for key in sorted(delta):
            x = delta[key].detach().float()
            if kept is not None and residual and key in residual:
                x = x + residual[key].float().reshape(x.shape)
            parts[key], n, rest = self.encode_one(x)
            nbytes += n
            shapes[key] = tuple(x.shape)
            if kept is not None:
                kept[key] = rest
        return Encoded(self.name, shapes, parts, nbytes), kept

    def decode(self, message: Encoded) -> Params:
        """The float32 update a message carries."""
        if message.codec != self.name:
            raise ValueError(f"a {message.codec} message given to the {self.name} codec")
        return {k: self.decode_one(message.parts[k], shape) for k, shape in message.shapes.items()}

    def encode_one(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], int, torch.Tensor | None]:
        """(the parts sent for one float32 tensor, their bytes, what is kept back: residual codecs)."""
        raise NotImplementedError

    def decode_one(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Dense(Codec):
    name: ClassVar[str] = "none"

    def encode_one(self, x):
        return {"values": x.clone()}, x.numel() * 4, None

    def decode_one(self, parts, shape):
        return parts["values"].float().reshape(shape)


@dataclass
class Half(Codec):
    """Each entry as a 16-bit float (:class:`Fp16`, :class:`Bf16`: the kind is the class)."""

    def dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.name]

    def encode_one(self, x):
        t = x.to(self.dtype())
        return {"values": t}, t.numel() * 2, None

    def decode_one(self, parts, shape):
        return parts["values"].float().reshape(shape)


@dataclass
class Fp16(Half):
    name: ClassVar[str] = "fp16"


@dataclass
class Bf16(Half):
    name: ClassVar[str] = "bf16"


@dataclass
class Int8Blocks(Codec):
    name: ClassVar[str] = "int8"
    block_size: int = 64

    @classmethod
    def of(cls, section):
        return cls(section.block_size)

    def encode_one(self, x):
        q, scales = int8_blocks(x.reshape(-1), self.block_size)
        return {"q": q, "scales": scales}, q.numel() + scales.numel() * 4, None

    def decode_one(self, parts, shape):
        n = math.prod(shape)
        return int8_read(parts["q"], parts["scales"], self.block_size)[:n].reshape(shape)


@dataclass
class TopK(Codec):
    name: ClassVar[str] = "topk"
    has_residual: ClassVar[bool] = True
    fraction: float = 0.01

    @classmethod
    def of(cls, section):
        return cls(section.topk_fraction)

    def count(self, n: int) -> int:
        """k = ⌈ρ n⌉, exactly: ρ as the decimal it was written as (ρ = 0.07 of 100 entries sends 7, where
        the float product 0.07 · 100 = 7.000000000000001 would send 8), at least 1."""
        return max(1, math.ceil(Fraction(repr(float(self.fraction))) * n))

    def encode_one(self, x):
        flat = x.reshape(-1)
        idx, values = top_k(flat, self.count(flat.numel()))
        rest = flat.clone()
        rest[idx.long()] = 0.0
        return {"indices": idx, "values": values}, idx.numel() * 4 + values.numel() * 4, rest.reshape(x.shape)

    def decode_one(self, parts, shape):
        flat = torch.zeros(math.prod(shape), dtype=torch.float32)
        flat[parts["indices"].long()] = parts["values"].float()
        return flat.reshape(shape)


CODECS: dict[str, type[Codec]] = {c.name: c for c in (Dense, Fp16, Bf16, Int8Blocks, TopK)}
"""The one registry of codecs, by the config's ``compression`` value (the schema's choices are its keys)."""
KINDS = tuple(CODECS)


def codec_from(section) -> Codec:
    """The codec a config section names (``clients.upload`` or ``server.download``), with its settings."""
    kind = section.compression
    if kind not in CODECS:
        raise ValueError(f"compression: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    return CODECS[kind].of(section)


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
