"""LoRA-specific FedAvg variants: FFA-LoRA and FedSA-LoRA."""

from __future__ import annotations

from fedsweep.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientInfo,
    ClientResult,
    Params,
    Payload,
    Report,
    ServerState,
    Upload,
    weighted_mean,
)
from fedsweep.algorithms.registry import register


def part(params: Params, factor: str) -> Params:
    return {k: v for k, v in params.items() if factor in k}


@register
class FFALoRA(Algorithm):
    """FFA-LoRA (Sun et al. 2024): A frozen at the shared random init, only B trained and averaged."""

    name = "ffa_lora"
    adapters = ("lora",)
    summary = "A frozen at a shared init; only B is trained, uploaded and averaged"

    def frozen(self, key: str) -> bool:
        return "lora_A" in key

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        return Upload(params=part(params, "lora_B"))

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
        b = weighted_mean([r.upload.params for r in results], [r.num_examples for r in results])
        state.globals = {**state.globals, **b}
        return state, Report()


@register
class FedSALoRA(Algorithm):
    """FedSA-LoRA (Guo et al. 2025): A shared and averaged, B kept local (personalised)."""

    name = "fedsa_lora"
    adapters = ("lora",)
    personalized = True
    summary = "A averaged across clients, B stays local"

    def init(self, params: Params, clients: list[ClientInfo]) -> ServerState:
        return ServerState(globals={k: v.clone() for k, v in part(params, "lora_A").items()})

    def client_prepare(self, ctx: ClientContext, payload: Payload) -> Params:
        return {**ctx.local_params, **(payload.params or {})}

    def client_eval_params(self, ctx: ClientContext, payload: Payload) -> Params:
        return self.client_prepare(ctx, payload)

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return Payload(params=state.globals)

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        return Upload(params=part(params, "lora_A"))

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
        state.globals = weighted_mean([r.upload.params for r in results], [r.num_examples for r in results])
        return state, Report()
