"""Which rows can be packed without padding (``train.pack_tokens``): the rule the config refuses with
and the engine checks, in the layer both read. The rows themselves are laid out by ``engine.packing``.
"""

from __future__ import annotations


def packing_refusal(objective: str, lora: bool, lora_dropout: float, sharded: bool) -> str | None:
    """Why ``train.pack_tokens`` cannot pack a run's rows; None where it can. The one rule: the config
    refuses with it from its fields, the engine (``engine.packing`` lays the rows out) from what it is
    given. Packing is SFT's and DPO's (a classification row's score is read at its padded row's last
    position), LoRA's (LoReFT intervenes at positions counted in the padded row), without LoRA dropout (a row's
    dropout mask is drawn for its padded row, ``models.stacked_lora.Draw``) and without a sharded
    client (its rows are split between processes)."""
    if objective not in ("sft", "dpo"):
        return f"train.pack_tokens packs SFT examples and DPO pairs; train.objective is {objective!r}"
    if not lora:
        return "train.pack_tokens packs LoRA rows; LoReFT intervenes at positions counted in the padded row"
    if lora_dropout:
        return "train.pack_tokens needs lora.dropout 0: a row's dropout mask is drawn for its padded row"
    if sharded:
        return "train.pack_tokens cannot pack a sharded client's rows: they are split between its processes"
    return None
