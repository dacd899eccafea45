"""A fast writer of safetensors files, and the size and SHA-256 of what it wrote.

``safetensors.torch.save_file`` costs Python per tensor (finding shared storage, one numpy view and
one pointer cast each). A client's checkpoint is hundreds of small tensors (each LoRA factor, its two
AdamW moments and its step counter), so at K = 50 that cost was most of a checkpoint (docs/performance.md, 'The design's measurements'). This writer produces the same
format from one buffer per dtype and device: the tensors are concatenated where they live (on
a GPU, one device-to-host copy instead of one per tensor) and written after a header that
indexes them, so the cost is the bytes, not the count. The files are read by safetensors'
own loader; the tests check every tensor against it.

Format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` padded with
spaces to a multiple of 8, then the data, every byte indexed exactly once. Groups are laid out
by element size, largest first, so every tensor's offset is a multiple of its element size.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass

from fedsweep.lazy import torch

DTYPE_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
"""torch's name of a dtype -> safetensors' name of it."""


def dtype_name(dtype: torch.dtype) -> str | None:
    """safetensors' name of ``dtype``, or None where this writer does not name it."""
    return DTYPE_NAMES.get(str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Digest:
    """The size in bytes and the SHA-256 (hex) of a file's content."""

    bytes: int
    sha256: str

    def as_json(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha256}


def supported(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether :func:`encode` can write these (a little-endian host, dtypes safetensors names)."""
    return sys.byteorder == "little" and all(dtype_name(d) for d in {t.dtype for t in tensors.values()})


def encode(tensors: dict[str, torch.Tensor]) -> list[memoryview | bytes]:
    """The file's content as chunks: header, then one buffer per dtype and device (see the module docstring).

    The buffers are copies: the chunks stay what the tensors were when this returned, however the
    tensors change after it (a checkpoint written while the next round trains)."""
    if "__metadata__" in tensors:
        raise ValueError("'__metadata__' is the format's own key, not a tensor name")
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name in sorted(tensors):  # a GPU's tensors and CPU ones (AdamW's step counters) apart
        groups.setdefault((tensors[name].dtype, tensors[name].device), []).append(name)
    order = sorted(groups, key=lambda g: (-g[0].itemsize, dtype_name(g[0]), str(g[1])))
    header: dict[str, dict] = {}
    chunks: list[memoryview | bytes] = []
    offset = 0
    for key in order:
        dtype, names = key[0], groups[key]
        named, size = dtype_name(dtype), dtype.itemsize
        flats = [tensors[n].detach().reshape(-1) for n in names]
        buffer = torch.cat(flats) if len(flats) > 1 else flats[0]
        buffer = buffer.to("cpu", copy=buffer is flats[0]).contiguous()  # never a view of a tensor
        for name, flat in zip(names, flats):
            end = offset + flat.numel() * size
            header[name] = {"dtype": named, "shape": list(tensors[name].shape),
                            "data_offsets": [offset, end]}
            offset = end
        if buffer.numel():
            chunks.append(memoryview(buffer.view(torch.uint8).numpy()))
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *chunks]


def write_chunks(path: str | os.PathLike, chunks: list[memoryview | bytes]) -> Digest:
    """Write ``chunks`` one after another to ``path``, fsynced; returns the size and SHA-256 of the whole."""
    sha, total = hashlib.sha256(), 0
    with open(path, "wb") as fh:
        for chunk in chunks:
            fh.write(chunk)
            sha.update(chunk)
            total += len(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    return Digest(total, sha.hexdigest())


def digest_of(data: bytes) -> Digest:
    """Size and SHA-256 of ``data``."""
    return Digest(len(data), hashlib.sha256(data).hexdigest())
