"""FedSA-LoRA (Guo et al. 2025, "Selective Aggregation for Low-Rank Adaptation in Federated Learning"):
A is shared and averaged, B stays with its client (personalised)."""

from __future__ import annotations

from fedsweep.algorithms.base import Algorithm, Capabilities
from fedsweep.algorithms.tensors import Params, weighted_mean
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientInfo, ClientResult, PLAIN, Payload,
                                       Report, ServerContext, ServerState, Upload)
from fedsweep.algorithms.registry import register


from fedsweep.algorithms.lora_factors import part


@register
class FedSALoRA(Algorithm):
    """FedSA-LoRA (Guo et al. 2025): A shared and averaged, B kept local (personalised)."""

    name = "fedsa_lora"
    capabilities = Capabilities(adapters=("lora",), personalized=True)
    summary = "A averaged across clients, B stays local"

    def init(self, params: Params, ctx: ServerContext) -> ServerState:
        return ServerState(globals={k: v.clone() for k, v in part(params, "lora_A").items()})

    def client_prepare(self, ctx: ClientContext, payload: Payload) -> Params:
        return {**ctx.local_params, **(payload.params or {})}

    def client_eval_params(self, ctx: ClientContext, payload: Payload) -> Params:
        return self.client_prepare(ctx, payload)

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return Payload(params=state.globals)

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        return Upload(params=part(params, "lora_A"))

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        state.globals = weighted_mean([r.upload.params for r in results], [r.num_examples for r in results])
        return state, Report()
