"""The plugin contract every federated method implements.

A plugin is pure tensor code on ``dict[str, Tensor]`` parameter sets plus optional
client hooks. It never touches Ray, files, the network or MLflow: it returns what it
wants logged in a :class:`~fedsweep.algorithms.types.Report`. The server side (``init``,
``dispatch``, ``aggregate``) runs inside the ServerActor; the hooks (``client_prepare``,
``client_loss``, ``client_upload``) run inside the ClientActor holding the client, where the clients
that train together are prepared and upload together (``client_prepare_group``,
``client_upload_group``: a method's own work in shared forwards, like the training).

What a method needs from the rest of the system (a validation pool, public prompts, a
sentence encoder, base merges, …) is declared once in its :class:`Capabilities`; the
runner, server and client ask that, never the method's class for loose flags.
docs/architecture.md walks through adding a method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from fedsweep.algorithms.tensors import Params, clone
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientResult, GroupTools, PLAIN, Payload,
                                       Report, ServerContext, ServerState, Upload)
from fedsweep.lazy import torch


class HyperParams(BaseModel):
    """Base of every method's hyperparameter section: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")


class NoParams(HyperParams):
    """A method without hyperparameters."""


ADAPTERS = ("lora", "reft")


@dataclass(frozen=True)
class Capabilities:
    """What a method needs from the system and what it accepts; declared once per plugin."""

    personalized: bool = False
    """Each client ends with its own adapter (the server keeps or routes one θ per client)."""
    adapters: tuple[str, ...] = ADAPTERS
    """Adapter kinds the method works with (LoRA-factor methods: lora only)."""
    mixed_ranks: bool = False
    """Clients may hold LoRA adapters of different ranks (methods averaging factors may not)."""
    mixed_models: bool = False
    """Clients may run different base models (only methods exchanging no parameters)."""
    centralized: bool = False
    """Reference row: client 0 trains on the union of all training data; the others only evaluate."""
    public_prompts: bool = False
    """The runner draws ``public_prompt_count(hp)`` records out of the data before partitioning and
    ``init`` receives them as ``ctx.public``."""
    validation_pool: bool = False
    """Every ClientActor receives the held-out pool (``ctx.pool_texts``, ``ctx.pool_loss``)."""
    client_encoder: bool = False
    """The ClientActor loads the sentence encoder named by the hyperparameter ``encoder`` and offers it
    as ``ctx.embed``."""
    server_encoder: bool = False
    """The ServerActor loads the sentence encoder named by the hyperparameter ``encoder`` and gives it to
    ``init`` and ``aggregate`` as ``ctx.embed`` (a resumed run calls no ``init``)."""
    exchanges_params: bool = True
    """Clients upload parameters (or updates of them) and receive parameters; False: the method exchanges
    only texts (FedCoFiT) or nothing (local training), so no codec, attack or robust rule applies."""
    averages_uploads: bool = False
    """The method's aggregation is the mean of the uploaded parameters it is given
    (``AggregationContext.mean``): a coordinate-wise robust rule (median, trimmed mean) can take that
    mean's place."""
    partial_sums: bool = False
    """The method reads its clients' uploads only through ``ctx.mean(uploads, num_examples)`` (with the
    results' counts and metrics): a client actor may then send one weighted partial sum of its clients'
    uploads, Σ_k n_k θ_k, instead of each upload (``server.partial_sums``), and the server's traffic does
    not grow with the clients."""
    base_merges: bool = False
    """Payloads carry ``base_version``/``base_deltas``: aggregates merged into the frozen base (which
    then cannot be quantised)."""
    start_sent: bool = True
    """Every round's payload carries the parameters the client starts from, so the server knows each
    update's start θ_start (``federation.update``). False: a client starts from parameters the server
    never sent (FLoRA: a fresh adapter every round; FlexLoRA: its own adapter in round 1), so a robust
    rule, which judges updates, is refused (it would judge whole adapters)."""
    one_download: bool = True
    """Every client of a round receives the same parameters (one global model). False: each gets its
    own (FlexLoRA truncates the global to each client's rank), so a compressed download, which keeps
    one replica for all, is refused."""

    def __post_init__(self) -> None:
        unknown = set(self.adapters) - set(ADAPTERS)
        if unknown or not self.adapters:
            raise ValueError(f"Capabilities.adapters: {sorted(unknown) or 'none'}; choose from {ADAPTERS}")


class Algorithm:
    """Base class: FedAvg-shaped defaults for every step; plugins override what differs.

    A plugin sets ``name`` (its registry key and config section), ``summary`` (one line for
    ``fedsweep algorithms``), ``Params`` (its hyperparameter section), ``capabilities`` and,
    rarely, ``config_defaults``; then overrides the steps it changes."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    capabilities: ClassVar[Capabilities] = Capabilities()
    config_defaults: ClassVar[dict[str, Any]] = {}
    """Experiment-config defaults of this method (dotted path -> value), applied where the file is silent."""

    def __init__(self, hp: BaseModel | None = None):
        self.hp = hp if hp is not None else self.Params()

    @classmethod
    def public_prompt_count(cls, hp: BaseModel) -> int:
        """How many records the runner removes from the data as public prompts (``capabilities.public_prompts``)."""
        return int(getattr(hp, "public_prompts", 0)) if cls.capabilities.public_prompts else 0

    def client_encoder_name(self) -> str | None:
        """The sentence encoder the ClientActor loads (once, lazily) and offers as ``ctx.embed``."""
        return getattr(self.hp, "encoder", None) if self.capabilities.client_encoder else None

    def server_encoder_name(self) -> str | None:
        """The sentence encoder the ServerActor loads and gives to ``init`` and ``aggregate`` (``ctx.embed``)."""
        return getattr(self.hp, "encoder", None) if self.capabilities.server_encoder else None

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Refuse an experiment config this method cannot run (raise ValueError, one line)."""
        caps = cls.capabilities
        if cfg.adapter not in caps.adapters:
            raise ValueError(f"algorithm '{cls.name}' works with adapter {' or '.join(caps.adapters)}, "
                             f"not '{cfg.adapter}'")
        models = sorted(set(cfg.client_models()))
        if len(models) > 1 and not caps.mixed_models:
            raise ValueError(
                f"algorithm '{cls.name}' exchanges parameters, so every client needs the same base model, but "
                f"model.names gives {models} (fedcofit exchanges texts and accepts mixed models)")
        ranks = sorted(set(cfg.client_ranks()))
        if len(ranks) > 1 and not caps.mixed_ranks:
            raise ValueError(
                f"algorithm '{cls.name}' averages LoRA factors and needs one rank for all clients, but "
                f"lora.ranks/lora.rank_choices give ranks {ranks} (flora and flexlora accept mixed ranks)")
        if caps.base_merges and cfg.model.quantization != "none":
            raise ValueError(f"algorithm '{cls.name}' merges the aggregate into the base weights, which a quantised "
                             f"base (model.quantization={cfg.model.quantization}) cannot hold: use model.quantization none")

    # ---------------------------------------------------------------- server side
    def init(self, params: Params, ctx: ServerContext) -> ServerState:
        """The server's state before round 1 from θ_0 (``params``) and the run's context (clients,
        public prompts, encoder, seed); a resumed run restores the state instead."""
        return ServerState(globals=clone(params))

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        payload = Payload(params=state.globals)  # one object: put in the object store once
        return {cid: payload for cid in sampled}

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        """The next state from the round's accepted ``results`` (screened, after any robust rule, each
        weighed by the example count the server assigned it) and a :class:`Report`. ``ctx`` carries
        the mean of uploads to use (a robust rule's centre where one takes its place) and the
        sentence encoder: the server composes it, nothing is assigned onto the method."""
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

    def client_prepare_group(self, ctxs: list[ClientContext], payloads: list[Payload], tools: GroupTools) -> list[Params]:
        """The start adapters of a training group's clients (one actor's clients that train together),
        all at once: a method whose preparation scores candidate adapters (FedReFT+'s α grid, pFedGPT's
        HBO) scores all of the group's in shared forwards with ``tools.losses``. Default: each
        client's :meth:`client_prepare`."""
        return [self.client_prepare(ctx, p) for ctx, p in zip(ctxs, payloads)]

    def client_loss(self, ctx: ClientContext, loss: torch.Tensor, params: Params) -> torch.Tensor:
        return loss

    def adds_loss_term(self) -> bool:
        """Whether this method's ``client_loss`` adds a term (is not the base class's identity)."""
        return type(self).client_loss is not Algorithm.client_loss

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        return Upload(params=params)

    def client_upload_group(self, ctxs: list[ClientContext], params: list[Params], tools: GroupTools) -> list[Upload]:
        """The uploads of a training group's clients, all at once: a method that generates with its
        clients' trained adapters (FedCoFiT) generates for all of the group with ``tools.generate``.
        Default: each client's :meth:`client_upload`."""
        return [self.client_upload(ctx, p) for ctx, p in zip(ctxs, params)]

    def client_eval_params(self, ctx: ClientContext, payload: Payload) -> Params:
        """The adapter a client is evaluated with, given its evaluation payload."""
        return payload.params if payload.params is not None else ctx.local_params

    def frozen(self, key: str) -> bool:
        """Adapter tensors the client must not train (FFA-LoRA freezes A)."""
        return False
