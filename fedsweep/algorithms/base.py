"""The plugin contract every federated method implements.

A plugin is pure tensor code on ``dict[str, Tensor]`` parameter sets plus optional
client hooks. It never touches Ray, files, the network or MLflow: it returns what it
wants logged in a :class:`Report`. The server side (``init``, ``dispatch``,
``aggregate``) runs inside the ServerActor; the hooks (``client_prepare``,
``client_loss``, ``client_upload``) run inside the ClientActor holding the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

Params = dict[str, torch.Tensor]


class NoParams(BaseModel):
    """A method without hyperparameters."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class ClientInfo:
    cid: int
    num_examples: int
    tasks: list[str] = field(default_factory=list)
    rank: int = 8
    """The client's LoRA rank."""
    lora_scale: float = 2.0
    """LoRA's α/r: the adapter adds lora_scale · B A to the base weight."""


@dataclass
class ServerState:
    """Everything the server keeps between rounds; checkpointed as safetensors + JSON."""

    globals: Params | None = None
    """One global θ (FedAvg-like methods)."""
    personal: dict[int, Params] = field(default_factory=dict)
    """One θ per client (personalised methods)."""
    buffers: dict[str, Params] = field(default_factory=dict)
    """Named tensor sets: optimiser moments, control variates, previous magnitudes…"""
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable scalars and lists."""


def compact(params: Params) -> Params:
    """``params`` with every tensor that is a view into a larger storage copied into its own.

    Pickling (Ray's transport, checkpoints) writes a tensor's whole storage: a dict of views into
    one flat buffer (DRIFT's mixed results, FedReFT+'s split aggregates) would otherwise carry the
    buffer once per view — a 240-tensor LoRA adapter became 240 copies of itself."""
    out = {}
    for key, t in params.items():
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        out[key] = t
    return out


class _CompactOnPickle:
    """Dataclass mixin: tensor dicts are compacted when the object is pickled (sent to an actor)."""

    _tensor_fields: ClassVar[tuple[str, ...]] = ("params", "tensors")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._tensor_fields:
            if isinstance(state.get(name), dict):
                state[name] = compact(state[name])
        return state


@dataclass
class Payload(_CompactOnPickle):
    """What one client receives for a round."""

    params: Params | None = None
    """Parameters to start from; ``None`` keeps the client's own."""
    tensors: Params = field(default_factory=dict)
    """Extra tensors (e.g. a server control variate)."""
    data: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable extras (e.g. pseudo-labelled public prompts). Keys the ClientActor
    itself reads: ``steps_scale`` (multiplies this round's local steps: the centralized row) and
    ``base_version`` (with ``tensors["base/<module>"]``: a cumulative update the actor keeps
    merged into its frozen base weights, applied once per version — FLoRA)."""


BASE_PREFIX = "base/"


@dataclass
class Upload(_CompactOnPickle):
    """What one client sends back after local training."""

    params: Params | None = None
    tensors: Params = field(default_factory=dict)
    texts: list[str] | None = None
    nbytes: int | None = None
    """Bytes actually sent when not the dense size of the above (sparse uploads)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Client-side scalars the hook wants logged (e.g. the share of entries uploaded)."""


@dataclass
class ClientResult:
    cid: int
    num_examples: int
    upload: Upload
    metrics: dict[str, float] = field(default_factory=dict)
    bytes_up: int = 0


@dataclass
class Report:
    """What an aggregation step wants logged: scalars, per-client scalars, artifacts."""

    metrics: dict[str, float] = field(default_factory=dict)
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    artifacts: dict[str, bytes] = field(default_factory=dict)
    """File name -> content (CSV, PNG, …), stored with the round's tracking run."""


@dataclass
class ClientContext:
    """What a client hook sees of the client it runs for."""

    cid: int
    rnd: int
    num_examples: int
    local_params: Params
    """The client's own parameters as they stood before this round."""
    state: Params
    """Algorithm-owned per-client tensors, persisted across rounds and checkpoints."""
    payload: Payload
    eval_loss: Callable[[Params, str], float] | None = None
    """``eval_loss(params, split)``: mean loss of ``params`` on a local split ('train', 'test')."""
    rank: int = 8
    lora_scale: float = 2.0
    steps: int = 0
    """Local optimiser steps this round."""
    learning_rate: float = 0.0
    fresh_params: Callable[[], Params] | None = None
    """A newly initialised adapter of this client's rank (LoRA A random, B zero)."""
    generate: Callable[..., list[str]] | None = None
    """``generate(prompts, max_new_tokens, **decoding)``: completions with the adapter just trained."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Algorithm-owned JSON-serialisable per-client state (lists, numbers, strings), persisted
    with the client's checkpoint next to ``state``."""
    train_loss: float | None = None
    """Mean local training loss of this round; set before ``client_upload`` runs."""
    local_texts: list[str] = field(default_factory=list)
    """The client's training examples as text (prompt and response)."""
    pool_texts: list[str] = field(default_factory=list)
    """The held-out validation pool as text (methods with ``uses_validation_pool``)."""
    pool_loss: Callable[[Params, list[int]], float] | None = None
    """``pool_loss(params, indices)``: mean token loss of ``params`` on those pool items."""
    embed: Callable[[list[str]], torch.Tensor] | None = None
    """``embed(texts)``: unit-norm sentence embeddings from the method's client encoder."""
    seed: int = 0
    """A seed for the hook's own randomness, derived from (config seed, round, client)."""


def tensor_bytes(params: Params | None) -> int:
    """Exact bytes of a tensor set as transmitted (dense, its dtype)."""
    if not params:
        return 0
    return sum(t.numel() * t.element_size() for t in params.values())


def payload_bytes(payload: Payload) -> int:
    """Bytes a client receives; ``data["bytes_down"]`` overrides the count where the payload
    carries more than the method transmits (FLoRA ships the cumulative merged update for
    clients that missed rounds, but a round transmits only its stacked factors)."""
    import json

    if "bytes_down" in payload.data:
        return int(payload.data["bytes_down"])
    extra = len(json.dumps(payload.data).encode()) if payload.data else 0
    return tensor_bytes(payload.params) + tensor_bytes(payload.tensors) + extra


def upload_bytes(upload: Upload) -> int:
    if upload.nbytes is not None:
        return upload.nbytes
    texts = sum(len(t.encode("utf-8")) for t in upload.texts) if upload.texts else 0
    return tensor_bytes(upload.params) + tensor_bytes(upload.tensors) + texts


def clone(params: Params) -> Params:
    return {k: v.detach().clone() for k, v in params.items()}


def weighted_mean(sets: list[Params], weights: list[float] | torch.Tensor) -> Params:
    """Σ_k w_k θ_k / Σ_k w_k, key by key, as one stacked reduction per tensor."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.ndim != 1 or len(w) != len(sets) or not len(sets):
        raise ValueError(f"need one weight per parameter set, got {len(w)} weights for {len(sets)} sets")
    if float(w.sum()) <= 0:
        raise ValueError("weights must sum to a positive number")
    w = w / w.sum()
    out: Params = {}
    for key in sets[0]:
        stacked = torch.stack([s[key] for s in sets])
        ww = w.to(device=stacked.device, dtype=torch.float32 if stacked.dtype != torch.float64 else torch.float64)
        out[key] = torch.tensordot(ww, stacked.to(ww.dtype), dims=1).to(stacked.dtype)
    return out


class Algorithm:
    """Base class: FedAvg-shaped defaults for every step; plugins override what differs."""

    name: ClassVar[str] = ""
    personalized: ClassVar[bool] = False
    Params: ClassVar[type[BaseModel]] = NoParams
    summary: ClassVar[str] = ""
    supports_mixed_ranks: ClassVar[bool] = False
    """Whether clients may hold LoRA adapters of different ranks (methods averaging factors may not)."""
    centralized: ClassVar[bool] = False
    """Reference row: one client trains on the union of all training data."""
    supports_mixed_models: ClassVar[bool] = False
    """Whether clients may run different base models (only methods exchanging no parameters)."""
    adapters: ClassVar[tuple[str, ...]] = ("lora", "reft")
    """Adapter kinds the method works with (LoRA-factor methods: lora only)."""
    uses_public_prompts: ClassVar[bool] = False
    """If set, ``init`` also receives ``public=`` the public prompt records."""
    config_defaults: ClassVar[dict[str, Any]] = {}
    """Experiment-config defaults of this method (dotted path -> value), applied where the file is silent."""
    uses_validation_pool: ClassVar[bool] = False
    """If set, every ClientActor receives the held-out pool (``ctx.pool_texts``, ``ctx.pool_loss``)."""

    def client_encoder_name(self) -> str | None:
        """A sentence encoder the ClientActor loads (once, lazily) and offers as ``ctx.embed``."""
        return None

    @classmethod
    def public_prompt_count(cls, hp: BaseModel) -> int:
        """How many records the runner removes from the data as public prompts."""
        return 0

    def encoder_name(self) -> str | None:
        """A sentence encoder the ServerActor loads and attaches as ``self.embed``."""
        return getattr(self.hp, "encoder", None) if self.uses_public_prompts else None

    def __init__(self, hp: BaseModel | None = None):
        self.hp = hp if hp is not None else self.Params()

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuse an experiment config this method cannot run (raise ValueError)."""
        if cfg.adapter not in cls.adapters:
            raise ValueError(f"algorithm '{cls.name}' works with adapter {' or '.join(cls.adapters)}, "
                             f"not '{cfg.adapter}'")
        models = sorted(set(cfg.client_models()))
        if len(models) > 1 and not cls.supports_mixed_models:
            raise ValueError(
                f"algorithm '{cls.name}' exchanges parameters, so every client needs the same base model, but "
                f"model.names gives {models} (fedcofit exchanges texts and accepts mixed models)")
        ranks = sorted(set(cfg.client_ranks()))
        if len(ranks) > 1 and not cls.supports_mixed_ranks:
            raise ValueError(
                f"algorithm '{cls.name}' averages LoRA factors and needs one rank for all clients, but "
                f"lora.ranks/lora.rank_choices give ranks {ranks} (flora and flexlora accept mixed ranks)")

    # ---------------------------------------------------------------- server side
    def init(self, params: Params, clients: list[ClientInfo]) -> ServerState:
        return ServerState(globals=clone(params))

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        payload = Payload(params=state.globals)  # one object: put in the object store once
        return {cid: payload for cid in sampled}

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
        raise NotImplementedError

    def final_payloads(self, state: ServerState, cids: list[int]) -> dict[int, Payload] | None:
        """Payloads of one more local update of clients ``cids`` after the last round's aggregation,
        before the final evaluation (FedCoFiT trains on the last consensus); None: no such update."""
        return None

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        """The parameters client ``cid`` is evaluated with after a round."""
        if cid in state.personal:
            return Payload(params=state.personal[cid])
        return Payload(params=state.globals)

    # ---------------------------------------------------------------- client side
    def client_prepare(self, ctx: ClientContext, payload: Payload) -> Params:
        return payload.params if payload.params is not None else ctx.local_params

    def client_loss(self, ctx: ClientContext, loss: torch.Tensor, params: Params) -> torch.Tensor:
        return loss

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        return Upload(params=params)

    def client_eval_params(self, ctx: ClientContext, payload: Payload) -> Params:
        """The adapter a client is evaluated with, given its evaluation payload."""
        return payload.params if payload.params is not None else ctx.local_params

    def frozen(self, key: str) -> bool:
        """Adapter tensors the client must not train (FFA-LoRA freezes A)."""
        return False
