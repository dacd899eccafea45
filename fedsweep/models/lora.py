"""LoRA adapters via peft, addressed as flat ``dict[str, Tensor]`` parameter sets.

Adapter names drop peft's wrapper prefix and adapter name, so a key reads
``model.layers.3.self_attn.q_proj.lora_A.weight``: module type, layer and factor are
all in the name, which is what the algorithms need.
"""

from __future__ import annotations

import torch

from fedsweep.algorithms.base import Params


class AdapterError(ValueError):
    pass


def clean_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".default.", ".")


def attach_lora(model, lora_cfg, seed: int):
    """Wrap ``model`` with a LoRA adapter; factor init is deterministic in ``seed``."""
    from peft import LoraConfig, get_peft_model

    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in lora_cfg.target_modules if m not in present]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise AdapterError(f"lora.target_modules: {missing} not in the model (linear modules: {', '.join(linear)})")
    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def adapter_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The trainable adapter parameters, by clean name, in a stable order."""
    return {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def read_adapter(model) -> Params:
    return {k: p.detach().clone() for k, p in adapter_parameters(model).items()}


def write_adapter(model, params: Params) -> None:
    live = adapter_parameters(model)
    if set(live) != set(params):
        extra, missing = sorted(set(params) - set(live))[:3], sorted(set(live) - set(params))[:3]
        raise AdapterError(f"adapter mismatch: unexpected {extra}, missing {missing}")
    with torch.no_grad():
        for k, p in live.items():
            p.copy_(params[k].to(device=p.device, dtype=p.dtype))
