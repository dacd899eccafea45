"""Compiled decoder layers (``train.compile``): the rule of what can be compiled, and the compiling.

A GPU step of a small model is bound by the host launching one kernel per operator (docs/gpu.md's
profile). ``torch.compile`` traces a decoder layer's forward (and
AOTAutograd its backward) into one graph; ``inductor`` generates fused kernels for it, ``aot_eager`` runs
the same traced graphs with torch's own operators (no generated code: it compiles in seconds anywhere,
which is what the CPU tests check the traced step with).

What is compiled is each decoder layer's ``forward`` (the classes the model names in
``_no_split_modules``), with the LoRA update of every wrapped module inside it
(``models.stacked_lora``: one hook function for every module, its factors read from the module), so all
layers of a model share one graph per variant, not one a layer. Shapes are dynamic (any number of rows,
any width: no bucketing is needed). The variants, each traced once and then reused: with and without
gradients, the first layer's input not requiring a gradient, and how the rows' owners are laid out
(one client, equal groups, mixed). A forward whose rows are all one client's in a group of several
indexes that client's factors by its number, a variant per client: rare where a group's forward holds
every client (``train.forwards: one``, a GPU's default), but the CPU's by-length forwards can make one
per client, and past :data:`RECOMPILE_LIMIT` torch runs the layer uncompiled (with its warning).
Decoding (a forward given a KV cache) runs the layer uncompiled: its cache grows by one position a step.
"""

from __future__ import annotations

from fedsweep.errors import ModelError
from fedsweep.lazy import torch

RECOMPILE_LIMIT = 32
"""Traced variants allowed per compiled function (torch's default, 8, is fewer than a step and its
evaluation make: past it, torch runs the layer uncompiled)."""


def compile_refusal(backend: str, lora: bool, lora_dropout: float, sharded: bool, checkpointing: bool,
                    quantized: bool) -> str | None:
    """Why ``train.compile`` cannot compile a run's layers; None where it can (or ``backend`` is ``off``).
    The one rule: the config refuses with it from its fields. Compiled are LoRA layers (LoReFT's
    interventions index positions per row from Python state), without LoRA dropout (its masks are drawn
    per row in Python, ``models.stacked_lora.Draw``), gradient checkpointing, a sharded client (its
    backend's hooks gather weights) or a quantised base (bitsandbytes' layers)."""
    if backend == "off":
        return None
    if not lora:
        return "train.compile compiles LoRA layers; LoReFT's interventions are placed per row in Python"
    if lora_dropout:
        return "train.compile needs lora.dropout 0: a row's dropout mask is drawn in Python"
    if checkpointing:
        return "train.compile does not compile layers recomputed by train.gradient_checkpointing"
    if sharded:
        return "train.compile cannot compile a sharded client's layers: its backend's hooks gather their weights"
    if quantized:
        return "train.compile cannot compile a quantised base (model.quantization: bitsandbytes' layers)"
    return None


def decoder_layers(model) -> list:
    """The decoder layers of ``model`` (a transformers model, peft-wrapped or not): the modules of the
    classes its ``_no_split_modules`` names, in order."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model, backend: str) -> int:
    """Compile every decoder layer's forward of ``model`` with ``backend`` (``inductor`` or ``aot_eager``),
    dynamic shapes; a call given a KV cache (decoding) runs the layer's own forward. Returns how many
    layers."""
    import torch._dynamo

    layers = decoder_layers(model)
    if not layers:
        raise ModelError(f"train.compile: {type(model).__name__} names no decoder layer class (_no_split_modules)")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # a binding attaches its hooks after a layer may have been traced without them (DPO's reference
    # forward runs on the bare base): torch skips guarding on module hooks unless told not to, and would
    # then run the graph traced without LoRA (measured: the evaluation of a trained adapter equal to the base's)
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    for layer in layers:
        layer.forward = _uncached_compiled(layer.forward, torch.compile(layer.forward, backend=backend, dynamic=True))
    return len(layers)


def _uncached_compiled(eager, compiled):
    """The layer's forward: ``compiled`` where no KV cache is given, ``eager`` where one is."""
    def forward(*args, **kwargs):
        return (eager if kwargs.get("past_key_values") is not None else compiled)(*args, **kwargs)

    forward.compiled = compiled
    return forward
