"""One interface over the adapter kinds the engine trains: LoRA (stacked factors) and LoReFT (hooks).

Both expose their tensors as flat ``dict[str, Tensor]`` parameter sets by clean names, so
algorithms never see which kind they aggregate, except through the names.

An adapter computes only inside a *binding*, entered per call: :meth:`bind` takes the adapters of
the 1..K clients of that call (their ranks and tensors, or all of them as one (K, P) tensor:
``algorithms.tensors.RowSets``) and returns an object that owns them for
the call — each client's trainable tensors (:meth:`Binding.params`), which client each row of a
forward belongs to (:meth:`Binding.rows`), the frozen base alone (:meth:`Binding.off`), each
client's result (:meth:`Binding.read`). Both bind any number of clients at once, stacked
(:class:`~fedsweep.models.stacked_lora.StackedLora`, :class:`~fedsweep.models.stacked_reft.StackedReft`).
Outside a binding the model computes the frozen base.
"""

from __future__ import annotations

import contextlib

from fedsweep.algorithms.tensors import Params, RowSets
from fedsweep.lazy import torch
from fedsweep.models import lora
from fedsweep.models.stacked_lora import Draw, StackedLora, lora_modules


class Binding:
    """The adapters of one call's clients, attached to the model until :meth:`close`."""

    size: int
    stacked: bool
    """Whether its tensors hold every client at once (dim 0 = client: the stacked optimisers)."""

    def params(self, k: int) -> dict[str, torch.Tensor]:
        """Client ``k``'s tensors (views: gradients flow to what :meth:`tensors` returns)."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.nn.Parameter]:
        """The leaf tensors an optimiser steps, by key."""
        raise NotImplementedError

    def view(self, tensor: torch.Tensor, key: str, k: int) -> torch.Tensor:
        """Client ``k``'s part of a tensor shaped like ``tensors()[key]``."""
        raise NotImplementedError

    def rows(self, owners: list[int], draws: list[Draw] | None = None):
        raise NotImplementedError

    def off(self):
        raise NotImplementedError

    def read(self, k: int) -> Params:
        raise NotImplementedError

    def read_all(self) -> list[Params]:
        """:meth:`read` of every client."""
        return [self.read(k) for k in range(self.size)]

    uniform = True
    """Whether every client's tensors fill the stacks (no rank padding)."""
    flat = None
    """The trained tensors' :class:`~fedsweep.models.flat.FlatStack` (one (K, P) buffer), where they
    have one."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LoraBinding(Binding):
    stacked = True

    def __init__(self, owner: "LoraAdapters", stack: StackedLora):
        self._owner, self.stack, self.size = owner, stack, len(stack.ranks)

    def params(self, k):
        return self.stack.client(k)

    def tensors(self):
        return self.stack.tensors()

    def view(self, tensor, key, k):
        return self.stack.view(tensor, key, k)

    def rows(self, owners, draws=None):
        return self.stack.rows(owners, draws)

    def off(self):
        return self.stack.off()

    def read(self, k):
        return self.stack.read(k)

    def read_all(self):
        return self.stack.read_all()

    @property
    def flat(self):
        return self.stack.trained

    @property
    def uniform(self):
        return self.stack.uniform

    def close(self):
        if self._owner._bound is self:
            self.stack.detach()
            self._owner._bound = None


class LoraAdapters:
    """LoRA on a shared frozen base: peft gives the modules, names and initial factors (one adapter
    per distinct client rank); the factors compute stacked, per call (:meth:`bind`)."""

    kind = "lora"
    groups = True

    def __init__(self, base, cfg, seed: int, ranks: list[int]):
        self.model = lora.attach_lora(base, cfg.lora, seed, ranks)
        self.model.base_model.disable_adapter_layers()  # for good: the stacks compute LoRA
        self.ranks = sorted(set(ranks))
        self.alpha, self.dropout = cfg.lora.alpha, cfg.lora.dropout
        self._bound: LoraBinding | None = None
        self._modules: list | None = None

    def initial(self, rank: int) -> Params:
        """peft's initial factors of ``rank`` (A Kaiming-uniform, seeded; B zero), CPU copies."""
        return lora.read_adapter(self.model, lora.adapter_name(rank))

    def bind(self, ranks: list[int], params: list[Params], trained=lambda key: True) -> LoraBinding:
        """``trained(key)``: whether a tensor is trained (the trained ones share one buffer)."""
        if self._bound is not None:
            raise RuntimeError("a LoRA binding is already attached: close it first")
        if self._modules is None:  # (the LoRA modules never change: one walk of the model, at the first bind)
            self._modules = lora_modules(self.model)
        sample = getattr(self._modules[0][1].lora_A, lora.adapter_name(ranks[0])).weight
        stack = StackedLora(self.model, ranks, self.alpha, self.dropout, sample.device, sample.dtype, trained,
                            modules=self._modules)
        stack.write_rows(params) if isinstance(params, RowSets) else stack.write_all(params)
        stack.attach()
        self._bound = LoraBinding(self, stack)
        return self._bound

    def frozen_base(self):
        """The model computes the frozen base (peft's layers are off; a binding must not be attached)."""
        if self._bound is not None:
            return self._bound.off()
        return contextlib.nullcontext()

    def positions(self, **_):
        return contextlib.nullcontext()

    def post_step(self, active: list[int] | None = None) -> None:
        pass

    def base_weights(self) -> dict[str, torch.nn.Parameter]:
        return lora.base_weights(self.model)

    def to(self, device: torch.device) -> None:
        """Move the adapter modules alone (the base, sharded, stays where its backend put it)."""
        for name, module in self.model.named_modules():
            if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
                module.to(device)


class ReftBinding(Binding):
    """The interventions of one call's clients, stacked (``models.stacked_reft``)."""

    stacked = True
    uniform = True

    def __init__(self, owner: "ReftAdapters", stack):
        self._owner, self.stack, self.size = owner, stack, stack.k

    def params(self, k):
        return self.stack.client(k)

    def tensors(self):
        return self.stack.tensors()

    def view(self, tensor, key, k):
        return self.stack.view(tensor, key, k)

    def rows(self, owners, draws=None):
        return self.stack.rows(owners)

    def off(self):
        return self._owner.hooks.disabled()

    def read(self, k):
        return self.stack.read(k)

    def read_all(self):
        return self.stack.read_all()

    @property
    def flat(self):
        return self.stack.trained

    def close(self):
        if self._owner._bound is self:
            self._owner.hooks.stack = None
            self._owner._bound = None


class ReftAdapters:
    """LoReFT interventions on the frozen base; one parameter set (``reft.rank``) per client, the clients
    of a call bound together (stacked)."""

    kind = "reft"
    groups = True

    def __init__(self, base, cfg, seed: int, ranks: list[int]):
        from fedsweep.models.reft import ReftHooks

        rc = cfg.reft
        self.model = base
        self.cfg = rc
        classes = len(cfg.data.labels) if cfg.train.objective == "classify" else 0
        self.hooks = ReftHooks(base, rc.rank, rc.layers, rc.tied, seed, rc.dropout, classes)
        self.ranks = [rc.rank]
        self._initial = {k: p.detach().to("cpu", copy=True) for k, p in self.hooks.parameters().items()}
        self._bound: ReftBinding | None = None
        self._active: list[int] | None = None

    def initial(self, rank: int) -> Params:
        return {k: v.clone() for k, v in self._initial.items()}

    def bind(self, ranks: list[int], params: list[Params], trained=lambda key: True) -> ReftBinding:
        from fedsweep.models.stacked_reft import StackedReft

        if self._bound is not None:
            raise RuntimeError("a LoReFT binding is already attached: close it first")
        device = next(iter(self.hooks.parameters().values())).device
        stack = StackedReft(self._initial, len(params), device, trained)
        stack.write_rows(params) if isinstance(params, RowSets) else stack.write_all(params)
        self.hooks.stack = stack
        self._bound = ReftBinding(self, stack)
        return self._bound

    def frozen_base(self):
        return self.hooks.disabled()

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Each row's client's classification head on ``z`` (``models.stacked_reft.StackedReft.head``)."""
        if not self.hooks.has_head:
            raise ValueError("no classification head: train.objective 'classify' attaches one")
        return self._bound.stack.head(z)

    def positions(self, prompt_lengths: torch.Tensor, offsets: torch.Tensor, width: int):
        from fedsweep.models.reft import prompt_masks

        first, last = prompt_masks(prompt_lengths, offsets, width, self.cfg.first, self.cfg.last)
        device = next(iter(self.hooks.parameters().values())).device  # where the interventions compute (a
        # sharded base's weights may be offloaded to the host)
        return self.hooks.positions(first.to(device), last.to(device))

    def post_step(self, active: list[int] | None = None) -> None:
        """Every R of the bound clients that stepped (``active``; all: None) re-orthonormalised."""
        if self._bound is not None:
            self._bound.stack.retract(active)

    def base_weights(self) -> dict[str, torch.nn.Parameter]:
        raise ValueError("base merging (flora) needs LoRA adapters")

    def to(self, device: torch.device) -> None:
        """Move the interventions alone (see :meth:`LoraAdapters.to`)."""
        self.hooks.modules.to(device)


def make_adapters(base, cfg, seed: int, ranks: list[int]):
    return (ReftAdapters if cfg.adapter == "reft" else LoraAdapters)(base, cfg, seed, ranks)
