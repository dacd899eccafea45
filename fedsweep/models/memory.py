"""Memory planner: what one ClientActor holds on its GPU, from a model config alone.

Nothing is loaded and nothing is allocated. Weights, adapters and optimiser state are counted
from shapes; the transient memory of one training step (activations kept for backward,
gradients, logits and the loss) and of one evaluation forward is *simulated*: the real model
(transformers, the configured dtype and gradient checkpointing, LoRA computed as the engine computes
it: peft's layers off, the factors stacked, ``models.stacked_lora``) runs forward and backward on
the ``meta`` device while :class:`LiveBytes` follows every tensor storage created
and freed, and keeps the peak. Attention is simulated with the footprint of a fused kernel
(FlashAttention / memory-efficient SDPA: output and log-sum-exp kept, no L×L matrix), which is
what SDPA runs on CUDA and on CPU for unpadded batches; ``eager`` attention runs as written.

Per actor hosting n clients (``clients.park`` decides where idle optimiser state waits)::

    base + live adapters + optimiser × (n if park == gpu else 1) + max(train step(m), evaluation)

where m is the clients per training step (``train.batch_clients``; 1 where clients train one at a
time). A group step of m clients is one step over m batches: the step's peak grows by the
activations of each further batch (the slope between simulated steps of one and two batches:
activations are linear in the rows) and by each client's stacked factors, their gradients and AdamW
moments (4 × 4 bytes per adapter parameter)::

    train step(m) = train step(1) + (m − 1) · slope + m · 16 · adapter parameters

``train.batch_clients: auto`` takes the largest m that fits (:meth:`MemoryPlan.batch_limit`).

A sharded client (``clients.shard``, G processes) holds per GPU a 1/G share of the base (none with
``offload: cpu``) plus the whole weights of the two largest units gathered at a time (the layer
computing and the next one prefetched), the whole adapter and optimiser state (replicated), and
the step of its ⌈batch/G⌉ rows; generation runs every prompt on every process.

Not counted: the CUDA context and allocator fragmentation (``RESERVE`` leaves room for them).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GiB = 2 ** 30
RESERVE = 0.10
"""Share of a GPU kept free for the CUDA context, kernels' workspaces and fragmentation."""


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the mode and still alive: ``live`` now, ``peak`` at most.

    Storages that existed before (weights) are not counted; a view counts once, with its storage."""

    def __init__(self, exclude: list[torch.Tensor] = ()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {t.untyped_storage()._cdata: 0 for t in exclude}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self._sizes:
                    continue
                size = storage.nbytes()
                self._sizes[key] = size
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


class _FusedAttention(torch.autograd.Function):
    """The memory of a fused causal attention kernel: keeps q, k, v, its output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fused_attention(module, query, key, value, attention_mask, **kwargs):
    out = _FusedAttention.apply(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def usable_bytes(gpu_bytes: float) -> float:
    """What a plan may fill of a GPU: all but ``RESERVE``."""
    return gpu_bytes * (1 - RESERVE)


@dataclass
class MemoryPlan:
    """Bytes one ClientActor needs on its device (see the module docstring for the sum)."""

    base: int
    """Frozen base weights (quantised, or in ``model.dtype``)."""
    live_adapters: int
    """The adapter modules attached to the base: one float32 set per distinct client rank."""
    optimizer_per_client: int
    """One client's optimiser state."""
    train_step: int
    """Peak of one training step beyond the resident weights: activations, gradients, logits, loss,
    and the active client's optimiser state when it is created."""
    evaluation: int
    """Peak of evaluation: the test-loss forward (no gradients) or generation's KV cache, the larger."""
    park: str
    shards: int = 1
    """Processes (GPUs) the base is sharded over; 1: not sharded."""
    gathered: int = 0
    """Sharded: whole weights of the units gathered at once (the two largest: computing, prefetched)."""
    batch_slope: int = 0
    """A group step's growth per further client's batch (activations, logits)."""
    stacked_per_client: int = 0
    """A client's stacked factors in a group step, with their gradients and AdamW moments."""
    batch_clients: int | None = 1
    """Clients per training step: 1 where they train one at a time, N (``train.batch_clients``), or
    None for ``auto`` (the most that fit: :meth:`batch_limit`; a layout is planned with 1)."""
    evaluation_slope: int = 0
    """Evaluation in one forward (``eval.forwards``: ``one``, or ``auto`` on a GPU): its growth per further
    client of the actor (that client's test rows and prompts in the same forward and generation)."""

    def evaluation_of(self, clients: int) -> int:
        """Peak of evaluation on an actor hosting ``clients`` (one forward: every one's rows at once)."""
        return self.evaluation + max(clients - 1, 0) * self.evaluation_slope

    def train_step_of(self, together: int) -> int:
        """Peak of a training step of a group of ``together`` clients (1: one client's step)."""
        if together <= 1:
            return self.train_step
        return self.train_step + (together - 1) * self.batch_slope + together * self.stacked_per_client

    def per_actor(self, clients: int, together: int | None = None) -> int:
        """Bytes on one GPU of an actor hosting ``clients`` (a sharded client: on each of its GPUs),
        ``together`` of them per training step (default: the plan's ``batch_clients``)."""
        parked = clients if self.park == "gpu" else 1
        m = min(clients, together or self.batch_clients or 1)
        return (self.base + self.gathered + self.live_adapters + self.optimizer_per_client * parked
                + max(self.train_step_of(m), self.evaluation_of(clients)))

    def clients_per_gpu(self, gpu_bytes: float, limit: int) -> int:
        """Most clients one actor (one base) can host on a GPU of ``gpu_bytes``; 0 if not even one fits."""
        usable = usable_bytes(gpu_bytes)
        return _largest(lambda n: self.per_actor(n) <= usable, limit)

    def batch_limit(self, gpu_bytes: float, clients: int) -> int:
        """``auto``: the most of an actor's ``clients`` one training step may take on a GPU of
        ``gpu_bytes`` (at least 1: one client at a time is the layout's own plan)."""
        usable = usable_bytes(gpu_bytes)
        return max(1, _largest(lambda m: self.per_actor(clients, together=m) <= usable, clients))

    def as_dict(self) -> dict:
        return asdict(self)


def _largest(fits, limit: int) -> int:
    """The largest n in [1, limit] with ``fits(n)`` (``fits`` monotone: true up to some n), 0 if none."""
    if limit < 1 or not fits(1):
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def hf_config(model_config: dict):
    """A transformers config from an architecture dict (``configs/models/*.json``)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in model_config.items() if not k.startswith("_")}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def meta_model(model_config: dict, dtype: torch.dtype, cfg, attn: str | None):
    from transformers import AutoModelForCausalLM

    from fedsweep.models.lora import attach_lora

    hf = hf_config(model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
    if attn == "eager":
        model.set_attn_implementation("eager")
    else:
        from transformers import AttentionInterface

        AttentionInterface.register("fedsweep_fused_shape", _fused_attention)
        model.set_attn_implementation("fedsweep_fused_shape")
    model.requires_grad_(False)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with torch.device("meta"):
        if cfg.adapter == "reft":  # the interventions' hooks, kept beside the model for _engine_reft
            from fedsweep.models.reft import ReftHooks

            classes = len(cfg.data.labels) if cfg.train.objective == "classify" else 0
            model.__dict__[REFT_SLOT] = ReftHooks(model, cfg.reft.rank, cfg.reft.layers, cfg.reft.tied, 0, 0.0, classes)
        else:
            model = attach_lora(model, cfg.lora, cfg.seed, sorted(set(cfg.client_ranks())))
    return model


REFT_SLOT = "_fedsweep_reft_hooks"
"""Where :func:`meta_model` leaves a LoReFT model's ``ReftHooks`` (a plain attribute of the model)."""


def adapter_parameters_per_client(model, cfg) -> dict[int, int]:
    """One client's trained parameters by rank: LoRA's per distinct rank, LoReFT's (one rank) with its head."""
    if cfg.adapter == "reft":
        return {cfg.reft.rank: sum(p.numel() for p in model.__dict__[REFT_SLOT].parameters().values())}
    from fedsweep.models.lora import adapter_name, adapter_parameters

    return {r: sum(p.numel() for p in adapter_parameters(model, adapter_name(r)).values())
            for r in sorted(set(cfg.client_ranks()))}


@contextlib.contextmanager
def _engine_reft(model, rows: int, length: int):
    """Inside it ``model``'s LoReFT interventions compute as the engine's do for one client (a stacked
    binding attached, every row that client's, every position intervened: the delta is computed over
    the whole hidden state before the positions are masked)."""
    from fedsweep.models.stacked_reft import StackedReft

    hooks = model.__dict__[REFT_SLOT]
    hooks.stack = StackedReft({k: v.detach() for k, v in hooks.parameters().items()}, 1, "meta")
    every = torch.ones((rows, length), dtype=torch.bool, device="meta")
    try:
        with hooks.stack.rows([0] * rows), hooks.positions(every, every):
            yield
    finally:
        hooks.stack = None


@contextlib.contextmanager
def _engine_lora(model, cfg, rows: int):
    """Inside it ``model``'s LoRA computes as the engine's does for one client of the largest rank
    (peft's layers off, a stacked binding attached, every row that client's; its factors exist
    already, like a bound group's)."""
    from fedsweep.models.stacked_lora import StackedLora

    model.base_model.disable_adapter_layers()
    # (the meta model is built in the compute dtype: under autocast the engine's LoRA input keeps it,
    # which factors of that dtype reproduce; without autocast the input is cast to the float32 factors')
    dtype = next(model.parameters()).dtype if cfg.train.autocast not in (None, "none") else torch.float32
    stack = StackedLora(model, [max(cfg.client_ranks())], cfg.lora.alpha, cfg.lora.dropout, "meta", dtype)
    stack.attach()
    try:
        with stack.rows([0] * rows):
            yield
    finally:
        stack.detach()
        model.base_model.enable_adapter_layers()


def step_peak(model, batch: int, length: int, train: bool, cfg) -> int:
    """Peak bytes of one forward (and backward, if ``train``) on an unpadded (batch, length) batch,
    loss as the actor computes it: the vocabulary projection at the gathered positions that predict a
    supervised token (here every position but the last: the worst case), fp32 cross-entropy."""
    ids = torch.zeros((batch, length), dtype=torch.long, device="meta")
    rows = torch.arange(batch, device="meta").repeat_interleave(length - 1)
    cols = torch.arange(length - 1, device="meta").repeat(batch)
    weights = [p for p in model.parameters()] + [b for b in model.buffers()]
    model.train(train)
    tracker = LiveBytes(exclude=weights)
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda module, args: (args[0][rows, cols].unsqueeze(0), *args[1:]))
    try:
        with contextlib.ExitStack() as stack:
            if cfg.adapter == "lora":
                stack.enter_context(_engine_lora(model, cfg, batch))
            else:
                stack.enter_context(_engine_reft(model, batch, length))
            if not train:
                stack.enter_context(torch.no_grad())
            stack.enter_context(tracker)
            logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[0].float(), ids[:, 1:].reshape(-1), reduction="none").sum()
            del logits
            if train:
                loss.backward()
            del loss
    finally:
        hook.remove()
    model.zero_grad(set_to_none=True)
    return tracker.peak


def kv_cache_bytes(model_config: dict, batch: int, tokens: int, dtype_bytes: int) -> int:
    """Generation's key/value cache: 2 · layers · batch · kv_heads · head_dim · tokens · bytes."""
    heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    kv = model_config.get("num_key_value_heads", heads)
    return 2 * model_config["num_hidden_layers"] * batch * kv * head_dim * tokens * dtype_bytes


def base_bytes(model, quantization: str, dtype_bytes: int) -> int:
    """Frozen weights: bitsandbytes quantises the decoder's Linear weights (8bit: one byte and an fp32
    scale per output row; 4bit NF4 with double quantisation: half a byte and ~0.127 bits of
    constants per weight); embeddings, norms and the output head keep ``dtype_bytes``."""
    total, seen = 0, set()
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if "lora_" in name or "lora_" in pname or id(p) in seen:  # tied embeddings count once
                continue
            seen.add(id(p))
            linear = isinstance(module, torch.nn.Linear) and "lm_head" not in name
            if linear and quantization == "8bit":
                total += p.numel() + 4 * p.shape[0]
            elif linear and quantization == "4bit":
                total += math.ceil(p.numel() * (0.5 + 0.127 / 8))
            else:
                total += p.numel() * dtype_bytes
    return total


def unit_bytes(model, dtype_bytes: int) -> list[int]:
    """Frozen weights of each unit a sharded base gathers whole: every decoder layer, and the root
    (embeddings, final norm, head: the rest)."""
    from fedsweep.models.sharding import layer_modules

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = [base_bytes(layer, "none", dtype_bytes) for layer in layer_modules(inner)]
    return layers + [base_bytes(inner, "none", dtype_bytes) - sum(layers)]


def parse_size(text: str) -> float:
    """``80GB``, ``80GiB``, ``24G``, ``512MiB`` -> bytes (GB taken as GiB, as GPU specs mean it)."""
    units = {"": 1, "b": 1, "k": 2 ** 10, "kb": 2 ** 10, "kib": 2 ** 10, "m": 2 ** 20, "mb": 2 ** 20, "mib": 2 ** 20,
             "g": GiB, "gb": GiB, "gib": GiB, "t": 2 ** 40, "tb": 2 ** 40, "tib": 2 ** 40}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"GPU memory {text!r}: expected a size like 80GB or 24GiB") from None
    unit = s[len(num):]
    if unit not in units or value <= 0:
        raise ValueError(f"GPU memory {text!r}: expected a size like 80GB or 24GiB")
    return value * units[unit]
