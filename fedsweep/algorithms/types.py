"""The data a round moves between the server, the plugin and the clients.

Plain dataclasses of tensors and JSON-serialisable values. Every field the ClientActor
itself acts on is a typed field here (``Payload.steps_scale``, ``base_version``,
``extra_train``, ``dp`` …); ``Payload.data`` and ``ClientContext.meta`` are left to the
method's own hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple

from fedsweep.algorithms.tensors import Params, RowSets, WireSet, from_wire, tensor_bytes, to_wire, weighted_mean
from fedsweep.lazy import torch


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
class ServerContext:
    """What the server side of a method is given at its start (``Algorithm.init``), as a client hook is
    given a :class:`ClientContext`: the clients, the public prompts drawn out of the data (methods
    whose capabilities ask for them), the sentence encoder (``server_encoder``) and the run's seed."""

    clients: list[ClientInfo] = field(default_factory=list)
    public: list[dict] | None = None
    embed: Callable[[list[str]], Any] | None = None
    seed: int = 0


@dataclass(frozen=True)
class AggregationContext:
    """What a method's ``aggregate`` is given beside the round's results and its state, made by the
    server's chain for each round (``federation.chain``): the mean of uploaded parameter sets it must
    use, Σ_k w_k θ_k / Σ_k w_k, or the coordinate-wise centre a robust rule puts in its place
    (``server.robust``; only for methods declaring ``capabilities.averages_uploads``); and the
    sentence encoder of a method with ``capabilities.server_encoder``."""

    mean: Callable[[list[Params], list[float]], Params] = weighted_mean
    embed: Callable[[list[str]], Any] | None = None


PLAIN = AggregationContext()
"""The context of a round without a robust rule or encoder: the weighted mean."""


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


class _CompactOnPickle:
    """Dataclass mixin: tensor dicts travel as numpy buffers when the object is pickled (sent to or
    from an actor), see :func:`~fedsweep.algorithms.tensors.to_wire`."""

    _tensor_fields: ClassVar[tuple[str, ...]] = ("params", "tensors")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._tensor_fields:
            if isinstance(state.get(name), dict):
                state[name] = to_wire(state[name])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in self._tensor_fields:
            if isinstance(state.get(name), WireSet):
                state[name] = from_wire(state[name])
        self.__dict__.update(state)


@dataclass(frozen=True)
class DPSettings:
    """DP-SGD on a client's private examples (record-level differential privacy)."""

    noise_multiplier: float
    """σ: Gaussian noise std as a multiple of ``max_grad_norm``."""
    max_grad_norm: float
    """C: per-example gradient clipping norm."""
    delta: float = 1e-5
    """δ of the (ε, δ) the accountant reports."""


@dataclass
class Payload(_CompactOnPickle):
    """What one client receives for a round."""

    _tensor_fields: ClassVar[tuple[str, ...]] = ("params", "tensors", "base_deltas")

    params: Params | None = None
    """Parameters to start from; ``None`` keeps the client's own."""
    tensors: Params = field(default_factory=dict)
    """Extra tensors for the method's own client hooks (e.g. a server control variate)."""
    data: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable extras for the method's own client hooks (e.g. FedCoFiT's public prompts).
    The ClientActor never reads it."""
    steps_scale: int = 1
    """Multiplies this round's local steps (the centralized row trains for the whole federation)."""
    base_version: int | None = None
    """With ``base_deltas``: a cumulative update the ClientActor keeps merged into its frozen base
    weights, W = W₀ + Δ, applied once per version (FLoRA). ``None``: the base is left as it is."""
    base_deltas: Params = field(default_factory=dict)
    """Δ per LoRA-wrapped module name (``model.layers.0.self_attn.q_proj``)."""
    extra_train: list[dict[str, Any]] = field(default_factory=list)
    """Extra examples ``{"prompt", "response", "eos"}`` sampled every local step beside the private
    ones (FedCoFiT's pseudo-labelled public prompts); ``eos: False`` trains without an end token."""
    extra_weight: float = 0.5
    """The extra stream's share of each step's loss: (1 − w)·private + w·extra."""
    dp: DPSettings | None = None
    """DP-SGD on the private stream (``engine/dp.py``); ``None``: plain steps."""
    bytes_down: int | None = None
    """Bytes this payload stands for when not its dense size (FLoRA ships the cumulative merged
    update for clients that missed rounds, but a round transmits only its stacked factors)."""


@dataclass
class Upload(_CompactOnPickle):
    """What one client sends back after local training."""

    params: Params | None = None
    tensors: Params = field(default_factory=dict)
    texts: list[str] | None = None
    nbytes: int | None = None
    """Bytes actually sent when not the dense size of the above (sparse uploads)."""
    sent_share: float | None = None
    """The share of ``params``' entries the method sends (a sparse upload, such as FedICU's importance
    mask; None: all of them): an upload codec charges that share of its encoded size."""
    encoded: Any = None
    """The update encoded by ``clients.upload``'s codec (``federation.codecs.Encoded``), in place of
    ``params``, until the server decodes it (``federation.chain``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Client-side scalars the hook wants logged (e.g. the share of entries uploaded)."""


@dataclass
class ClientResult:
    cid: int
    num_examples: int
    upload: Upload
    metrics: dict[str, float] = field(default_factory=dict)
    bytes_up: int = 0
    screen: dict[str, Any] | None = None
    """Where the client actor sent a partial sum instead of the upload (``upload.params`` None): the
    update's norm, its start's norm and any non-finite tensor, measured there for the server's
    screening (``federation.screening.update_norm``)."""


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


class Candidate(NamedTuple):
    """An adapter to score for one client of a training group (``GroupTools.losses``)."""

    client: int
    """The client's place in the group (its context's index)."""
    params: Params
    on: str | list[int]
    """Where its mean token loss is taken: a local split ('train', 'val', 'test') or held-out pool indices."""


class Generation(NamedTuple):
    """Prompts one client of a training group completes with its adapter just trained (``GroupTools.generate``)."""

    client: int
    prompts: list[str]
    max_new_tokens: int


@dataclass
class GroupTools:
    """What a client actor offers a method's group hooks (``client_prepare_group``, ``client_upload_group``):
    its work for all of a training group's clients at once, in shared forwards, as its training is."""

    losses: Callable[[list[Candidate]], list[float]]
    """Each candidate adapter's mean token loss, every candidate of every client bound together."""
    generate: Callable[[list[Generation]], list[tuple[list[str], list[bool]]]]
    """Greedy completions of every request (each client's prompts with its trained adapter) in shared
    generation batches: per request its texts and whether each was cut by ``max_new_tokens``."""
    row_losses: Callable[[list[int], RowSets, list], list[float]] | None = None
    """``row_losses(clients, sets, on)``: the same losses for candidates computed as one (N, P) tensor (row i
    client ``clients[i]``'s candidate, its loss taken on ``on[i]``), bound in one copy per tensor."""


def payload_bytes(payload: Payload) -> int:
    """Bytes a client receives: the tensors and JSON extras, or ``payload.bytes_down`` where set."""
    import json

    if payload.bytes_down is not None:
        return int(payload.bytes_down)
    extra = len(json.dumps(payload.data).encode()) if payload.data else 0
    texts = len(json.dumps(payload.extra_train).encode()) if payload.extra_train else 0
    return tensor_bytes(payload.params) + tensor_bytes(payload.tensors) + tensor_bytes(payload.base_deltas) + extra + texts


def upload_bytes(upload: Upload) -> int:
    """Bytes a client sends: the tensors and texts, or ``upload.nbytes`` where set (sparse uploads)."""
    if upload.nbytes is not None:
        return upload.nbytes
    texts = sum(len(t.encode("utf-8")) for t in upload.texts) if upload.texts else 0
    return tensor_bytes(upload.params) + tensor_bytes(upload.tensors) + texts
