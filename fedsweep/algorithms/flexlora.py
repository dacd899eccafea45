"""FlexLoRA (Bai et al. 2024, "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and
Client Resources"): heterogeneous ranks through a per-client truncated SVD.

Server: ΔW = Σ_k p_k s_k B_k A_k (exact, from stacked factors); for every client rank r_k,
the rank-r_k truncated SVD of ΔW gives that client's next factors (B_k', A_k') with
s_k B_k' A_k' = ΔW's best rank-r_k approximation. ΔW is never formed densely: the SVD runs
on QR factors of the stack (see ``lora_stack.truncated_factors``).
"""

from __future__ import annotations

from fedsweep.algorithms.base import Algorithm, Capabilities
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import (AggregationContext, ClientInfo, ClientResult, PLAIN, Payload, Report,
                                       ServerContext, ServerState)
from fedsweep.algorithms.lora_stack import A, B, client_meta, scales, stacked_factors, truncated_factors
from fedsweep.algorithms.registry import register


@register
class FlexLoRA(Algorithm):
    capabilities = Capabilities(adapters=("lora",), mixed_ranks=True, start_sent=False, one_download=False)
    name = "flexlora"
    summary = "average full-size ΔW, then per-client truncated SVD to each client's rank"

    def init(self, params: Params, ctx: ServerContext) -> ServerState:
        return ServerState(meta=client_meta(ctx.clients))

    def _payload(self, state: ServerState, cid: int, cache: dict) -> Payload:
        rank = state.meta["ranks"][str(cid)]
        factors = state.buffers.get(f"r{rank}")
        if factors is None:
            return Payload()  # before the first aggregation: start from the client's own adapter
        if rank not in cache:
            cache[rank] = Payload(params=factors)
        return cache[rank]

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        cache: dict = {}
        return {cid: self._payload(state, cid, cache) for cid in sampled}

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return self._payload(state, cid, {})

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        by_client = scales(state.meta)
        stacks = stacked_factors(results, by_client)
        rank_scale = {int(r): by_client[int(c)] for c, r in state.meta["ranks"].items()}  # s = α/r per rank
        for rank, scale in sorted(rank_scale.items()):
            factors = {}
            for m, (b, a) in stacks.items():
                factors[m + B], factors[m + A] = truncated_factors(b, a, rank, scale)
            state.buffers[f"r{rank}"] = factors
        return state, Report()
