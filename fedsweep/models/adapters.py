"""One interface over the adapter kinds a ClientActor trains: LoRA (peft) and LoReFT (hooks).

Both expose their tensors as flat ``dict[str, Tensor]`` parameter sets by clean names, so
algorithms never see which kind they aggregate, except through the names.
"""

from __future__ import annotations

import contextlib

from fedsweep.algorithms.tensors import Params
from fedsweep.lazy import torch
from fedsweep.models import lora


class LoraAdapters:
    """One peft LoRA adapter per distinct client rank on a shared frozen base."""

    kind = "lora"

    def __init__(self, base, cfg, seed: int, ranks: list[int]):
        self.model = lora.attach_lora(base, cfg.lora, seed, ranks)
        self.ranks = sorted(set(ranks))

    def activate(self, rank: int) -> dict[str, torch.nn.Parameter]:
        name = lora.adapter_name(rank)
        if self.model.active_adapter != name:
            self.model.set_adapter(name)
        return lora.adapter_parameters(self.model, name)

    def read(self, rank: int) -> Params:
        return lora.read_adapter(self.model, lora.adapter_name(rank))

    def write(self, params: Params, rank: int) -> None:
        lora.write_adapter(self.model, params, lora.adapter_name(rank))

    def disabled(self):
        return self.model.disable_adapter()

    def positions(self, **_):
        return contextlib.nullcontext()

    def post_step(self) -> None:
        pass

    def base_weights(self) -> dict[str, torch.nn.Parameter]:
        return lora.base_weights(self.model)

    def to(self, device: torch.device) -> None:
        """Move the adapter modules alone (the base, sharded, stays where its backend put it)."""
        for name, module in self.model.named_modules():
            if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
                module.to(device)


class ReftAdapters:
    """LoReFT interventions on the frozen base; one parameter set (``reft.rank``) for all clients."""

    kind = "reft"

    def __init__(self, base, cfg, seed: int, ranks: list[int]):
        from fedsweep.models.reft import ReftHooks

        rc = cfg.reft
        self.model = base
        self.cfg = rc
        self.hooks = ReftHooks(base, rc.rank, rc.layers, rc.tied, seed, rc.dropout)
        self.ranks = [rc.rank]
        self._live = self.hooks.parameters()

    def activate(self, rank: int) -> dict[str, torch.nn.Parameter]:
        return self._live

    def read(self, rank: int) -> Params:
        return {k: p.detach().to("cpu", copy=True) for k, p in self._live.items()}  # see lora.read_adapter

    def write(self, params: Params, rank: int) -> None:
        if set(params) != set(self._live):
            raise ValueError(f"intervention mismatch: {sorted(set(params) ^ set(self._live))[:3]}")
        with torch.no_grad():
            for k, p in self._live.items():
                p.copy_(params[k].to(p.device, p.dtype))

    def disabled(self):
        return self.hooks.disabled()

    def positions(self, prompt_lengths: torch.Tensor, offsets: torch.Tensor, width: int):
        from fedsweep.models.reft import prompt_masks

        first, last = prompt_masks(prompt_lengths, offsets, width, self.cfg.first, self.cfg.last)
        device = next(iter(self._live.values())).device  # where the interventions compute (a sharded base's
        # weights may be offloaded to the host)
        return self.hooks.positions(first.to(device), last.to(device))

    def post_step(self) -> None:
        self.hooks.retract()

    def base_weights(self) -> dict[str, torch.nn.Parameter]:
        raise ValueError("base merging (flora) needs LoRA adapters")

    def to(self, device: torch.device) -> None:
        """Move the interventions alone (see :meth:`LoraAdapters.to`)."""
        self.hooks.modules.to(device)
        self._live = self.hooks.parameters()


def make_adapters(base, cfg, seed: int, ranks: list[int]):
    return (ReftAdapters if cfg.adapter == "reft" else LoraAdapters)(base, cfg, seed, ranks)
