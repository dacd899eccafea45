"""Local-only reference: every client trains on its own data, nothing is aggregated."""

from __future__ import annotations

from fedsweep.algorithms.base import Algorithm, Capabilities
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import (AggregationContext, ClientInfo, ClientResult, PLAIN, Payload, Report,
                                       ServerContext, ServerState, Upload)
from fedsweep.algorithms.registry import register


@register
class Local(Algorithm):
    """No aggregation: each client keeps θ_k; nothing is sent either way."""

    name = "local"
    capabilities = Capabilities(personalized=True, exchanges_params=False)
    summary = "no aggregation (reference row)"

    def init(self, params: Params, ctx: ServerContext) -> ServerState:
        return ServerState()

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        return {cid: Payload() for cid in sampled}

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        return state, Report()

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return Payload()

    def client_upload(self, ctx, params: Params) -> Upload:
        return Upload()
