"""Selecting one LoRA factor (A or B) out of an adapter's tensors."""

from __future__ import annotations

from fedsweep.algorithms.tensors import Params


def part(params: Params, factor: str) -> Params:
    """The tensors of ``params`` that belong to ``factor`` (``lora_A`` or ``lora_B``)."""
    return {k: v for k, v in params.items() if factor in k}
