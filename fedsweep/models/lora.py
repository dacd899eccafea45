"""LoRA adapters via peft, addressed as flat ``dict[str, Tensor]`` parameter sets.

Adapter names drop peft's wrapper prefix and adapter name, so a key reads
``model.layers.3.self_attn.q_proj.lora_A.weight``: module type, layer and factor are
all in the name, which is what the algorithms need.
"""

from __future__ import annotations

import re

from fedsweep.algorithms.tensors import Params
from fedsweep.errors import AdapterError
from fedsweep.lazy import torch
from fedsweep.salts import adapter_init_seed


_ADAPTER = re.compile(r"\.(lora_[AB])\.[^.]+\.")


def clean_name(name: str) -> str:
    """``base_model.model.X.q_proj.lora_A.r8.weight`` -> ``X.q_proj.lora_A.weight``."""
    return _ADAPTER.sub(r".\1.", name.removeprefix("base_model.model."))


def adapter_name(rank: int) -> str:
    return f"r{rank}"


def attach_lora(model, lora_cfg, seed: int, ranks: list[int] | None = None):
    """Wrap ``model`` with one LoRA adapter per distinct rank (named ``r<rank>``).

    Factor init is deterministic in ``seed`` and the rank. Only the first adapter is active.
    """
    from peft import LoraConfig, get_peft_model

    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in lora_cfg.target_modules if m not in present]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise AdapterError(f"lora.target_modules: {missing} not in the model (linear modules: {', '.join(linear)})")
    peft_model = None
    for rank in sorted(set(ranks or [lora_cfg.r])):
        config = LoraConfig(r=rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                            target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(adapter_init_seed(seed, rank))
            if peft_model is None:
                peft_model = get_peft_model(model, config, adapter_name=adapter_name(rank))
                first = adapter_name(rank)
            else:
                peft_model.add_adapter(adapter_name(rank), config)
    peft_model.set_adapter(first)
    return peft_model


def adapter_parameters(model, name: str | None = None) -> dict[str, torch.nn.Parameter]:
    """An adapter's parameters (default: the active one), by clean name, in a stable order."""
    name = name or model.active_adapter
    tag = f".{name}."
    return {clean_name(n): p for n, p in model.named_parameters() if "lora_" in n and tag in n}


def read_adapter(model, name: str | None = None) -> Params:
    """A CPU copy of an adapter: algorithms and the server compute with CPU tensors, and a GPU
    actor's upload must unpickle in a server process that has no GPU."""
    return {k: p.detach().to("cpu", copy=True) for k, p in adapter_parameters(model, name).items()}


def base_weights(model) -> dict[str, torch.nn.Parameter]:
    """The frozen base weight under each LoRA-wrapped module, by clean module name."""
    out = {}
    for n, m in model.named_modules():
        if hasattr(m, "base_layer") and hasattr(m, "lora_A"):
            out[n.removeprefix("base_model.model.")] = m.base_layer.weight
    return out


def write_adapter(model, params: Params, name: str | None = None) -> None:
    live = adapter_parameters(model, name)
    if set(live) != set(params):
        extra, missing = sorted(set(params) - set(live))[:3], sorted(set(live) - set(params))[:3]
        raise AdapterError(f"adapter mismatch: unexpected {extra}, missing {missing}")
    with torch.no_grad():
        for k, p in live.items():
            p.copy_(params[k].to(device=p.device, dtype=p.dtype))
