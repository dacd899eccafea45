"""LoReFT interventions (Wu et al. 2024, "ReFT: Representation Finetuning for Language Models"; FedReFT+ eq. 1) on torch forward hooks.

    Φ(h) = h + Rᵀ(W h + b − R h),   R ∈ ℝ^{r×d} with orthonormal rows, W ∈ ℝ^{r×d}, b ∈ ℝ^r

optionally followed by dropout on Φ(h) during training (``reft.dropout``, default 0), applied
to the output hidden state of chosen decoder layers at the first ``p`` and last
``s`` prompt positions. ``tied``: one intervention per layer for all those positions;
untied: one for the first-p group and one for the last-s group. The backbone stays frozen.

R's rows are kept orthonormal by a QR retraction after every optimiser step (and after
any mixing), an equivalent of torch's orthogonal parametrisation that keeps R a plain
tensor that can be exchanged, averaged and saved as safetensors. The hooks compute with the
interventions of the clients bound for the call, stacked (``models.stacked_reft``): one or many
clients per forward, each row with its own client's.

Trainable size (tied, L layers, width d): L(2rd + r).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from fedsweep.algorithms.fedreft import orthonormalize_rows as _qr_rows

GROUPS_TIED = ("all",)
GROUPS_UNTIED = ("first", "last")


def orthonormalize_rows(r: torch.Tensor) -> torch.Tensor:
    if r.device.type == "meta":
        return r
    return _qr_rows(r)


class LoReFT(nn.Module):
    def __init__(self, d: int, r: int, generator: torch.Generator | None = None):
        super().__init__()
        self.R = nn.Parameter(orthonormalize_rows(torch.randn(r, d, generator=generator)))
        bound = 1.0 / math.sqrt(d)
        self.W = nn.Parameter((torch.rand(r, d, generator=generator) * 2 - 1) * bound)
        self.b = nn.Parameter(torch.zeros(r))

    def delta(self, h: torch.Tensor) -> torch.Tensor:
        """Rᵀ(W h + b − R h)."""
        r, w, b = self.R.to(h.dtype), self.W.to(h.dtype), self.b.to(h.dtype)
        return (h @ w.T + b - h @ r.T) @ r

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.delta(h)


class ClassificationHead(nn.Module):
    """FedReFT+ eq. 3 (ReFT's GLUE head): H_ψ(z) = softmax(W_o · tanh(W_d z + b_d) + b_o), ψ = {W_o, b_o,
    W_d, b_d}, on the final layer's representation z ∈ ℝ^d; :meth:`forward` returns the logits (the
    softmax is the cross-entropy's). W_d and W_o are drawn N(0, 0.02²), the biases zero (RoBERTa's head)."""

    def __init__(self, d: int, classes: int, generator: torch.Generator | None = None):
        super().__init__()
        self.W_d = nn.Parameter(torch.randn(d, d, generator=generator) * 0.02)
        self.b_d = nn.Parameter(torch.zeros(d))
        self.W_o = nn.Parameter(torch.randn(classes, d, generator=generator) * 0.02)
        self.b_o = nn.Parameter(torch.zeros(classes))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z.to(self.W_d.dtype)
        return torch.tanh(z @ self.W_d.T + self.b_d) @ self.W_o.T + self.b_o


def decoder_layers(model) -> nn.ModuleList:
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers", "layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def hidden_size(model) -> int:
    return int(model.config.hidden_size)


def build_interventions(d: int, num_layers: int, layers: list[int] | None, rank: int, tied: bool,
                        seed: int = 0) -> nn.ModuleDict:
    """``layers.<l>.<group>`` -> LoReFT, deterministic in ``seed``."""
    chosen = list(range(num_layers)) if layers is None else layers
    bad = [l for l in chosen if not 0 <= l < num_layers]
    if bad:
        raise ValueError(f"reft.layers {bad} outside 0..{num_layers - 1}")
    gen = torch.Generator().manual_seed(seed) if torch.empty(0).device.type != "meta" else None
    mods = nn.ModuleDict()
    for l in chosen:
        for g in (GROUPS_TIED if tied else GROUPS_UNTIED):
            mods[f"layers_{l}_{g}"] = LoReFT(d, rank, gen)
    return mods


class ReftHooks:
    """Interventions on a model's decoder layers: the initial ones (built here, seeded), and forward hooks
    that apply the attached clients' (:attr:`stack`, a ``models.stacked_reft.StackedReft``; none
    attached: the frozen base) at the positions set per forward."""

    def __init__(self, model, rank: int, layers: list[int] | None, tied: bool, seed: int, dropout: float = 0.0,
                 classes: int = 0):
        self.model = model
        self.tied = tied
        self.dropout = dropout
        blocks = decoder_layers(model)
        self.modules = build_interventions(hidden_size(model), len(blocks), layers, rank, tied, seed)
        if classes:  # the classification head of eq. 3, drawn from its own stream
            from fedsweep.salts import CLASSIFICATION_HEAD, derive_seed

            head_seed = derive_seed(seed, CLASSIFICATION_HEAD)
            gen = torch.Generator().manual_seed(head_seed) if torch.empty(0).device.type != "meta" else None
            self.modules["head"] = ClassificationHead(hidden_size(model), classes, gen)
        self.modules.to(next(model.parameters()).device)
        self.masks: dict[str, torch.Tensor] | None = None
        self.enabled = True
        self.stack = None
        """The attached clients' interventions (``StackedReft``), or None."""
        self._handles = []
        for key in self.modules:
            if key == "head":
                continue
            l = int(key.split("_")[1])
            if key.endswith(GROUPS_TIED[0]) or key.endswith("first"):
                self._handles.append(blocks[l].register_forward_hook(self._hook(l)))

    def _hook(self, layer: int):
        def apply(module, args, output):
            if not self.enabled or self.masks is None or self.stack is None:
                return output
            h = output[0] if isinstance(output, tuple) else output
            groups = GROUPS_TIED if self.tied else GROUPS_UNTIED
            for g in groups:
                mask = self.masks["all" if self.tied else g]
                if mask.shape != h.shape[:2]:
                    return output  # an incremental generation step: no prompt positions here
                m = mask.unsqueeze(-1).to(h.dtype)
                phi = h + self.stack.delta(f"reft.layers.{layer}.{g}", h)  # Φ(h), eq. 1
                if self.dropout > 0 and module.training:
                    phi = torch.nn.functional.dropout(phi, self.dropout, training=True)
                h = h + m * (phi - h)
            return (h, *output[1:]) if isinstance(output, tuple) else h
        return apply

    def parameters(self) -> dict[str, nn.Parameter]:
        """The initial interventions, ``reft.layers.<l>.<group>.<W|R|b>`` -> parameter, in a stable order."""
        out = {}
        for key, mod in self.modules.items():
            if key == "head":
                continue
            _, l, g = key.split("_")
            for name in ("W", "R", "b"):
                out[f"reft.layers.{l}.{g}.{name}"] = getattr(mod, name)
        if "head" in self.modules:  # ``reft.head.<W_d|b_d|W_o|b_o>``: FedReFT+ shares none of these (its W, R, b)
            for name in ("W_d", "b_d", "W_o", "b_o"):
                out[f"reft.head.{name}"] = getattr(self.modules["head"], name)
        return out

    @property
    def has_head(self) -> bool:
        return "head" in self.modules

    @contextlib.contextmanager
    def positions(self, first: torch.Tensor, last: torch.Tensor):
        self.masks = {"first": first, "last": last, "all": first | last}
        try:
            yield
        finally:
            self.masks = None

    @contextlib.contextmanager
    def disabled(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


def prompt_masks(prompt_lengths: torch.Tensor, offsets: torch.Tensor, width: int, p: int, s: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) boolean (B, width) masks: the first ``p`` and last ``s`` prompt tokens.

    Prompt i occupies positions [offsets_i, offsets_i + prompt_lengths_i); the two groups
    never overlap (the last group starts after the first when a prompt is short).
    """
    pos = torch.arange(width).unsqueeze(0)
    start = offsets.unsqueeze(1)
    end = start + prompt_lengths.unsqueeze(1)
    first_end = torch.minimum(start + p, end)
    first = (pos >= start) & (pos < first_end)
    last = (pos >= torch.maximum(end - s, first_end)) & (pos < end)
    return first, last


def count_parameters(d: int, num_layers: int, rank: int, tied: bool = True, layers: list[int] | None = None) -> int:
    """Trainable intervention parameters, counted on the meta device (no memory)."""
    with torch.device("meta"):
        mods = build_interventions(d, num_layers, layers, rank, tied)
    return sum(p.numel() for p in mods.parameters())
