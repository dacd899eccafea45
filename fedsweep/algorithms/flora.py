"""FLoRA (Wang et al. 2024, "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
Low-Rank Adaptations"): stacking aggregation for heterogeneous LoRA ranks.

Each round the server forms ΔW = Σ_k p_k s_k B_k A_k exactly by stacking the factors (no
cross terms), and the update is merged into the frozen base; clients re-initialise their
LoRA every round. The server keeps the cumulative merged update and sends it versioned:
a ClientActor applies it to its (shared) base once per version, so clients packed on one
base stay consistent, and a client that missed rounds catches up. Bytes down count what
FLoRA transmits in a round: the stacked factors of that round.
"""

from __future__ import annotations

from fedsweep.algorithms.base import Algorithm, Capabilities
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientInfo, ClientResult, PLAIN, Payload,
                                       Report, ServerContext, ServerState)
from fedsweep.algorithms.lora_stack import client_meta, scales, stacked_factors
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch


@register
class FLoRA(Algorithm):
    capabilities = Capabilities(adapters=("lora",), mixed_ranks=True, base_merges=True, start_sent=False,
                                one_download=False)
    name = "flora"
    summary = "stacked Σ p_k s_k B_k A_k merged into the base each round; clients re-initialise LoRA"

    def init(self, params: Params, ctx: ServerContext) -> ServerState:
        return ServerState(meta={"version": 0, "bytes_down": 0, **client_meta(ctx.clients)})

    def _payload(self, state: ServerState) -> Payload:
        return Payload(base_version=state.meta["version"], base_deltas=dict(state.buffers.get("base", {})),
                       bytes_down=state.meta["bytes_down"])

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        payload = self._payload(state)
        return {cid: payload for cid in sampled}

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return self._payload(state)

    def client_prepare(self, ctx: ClientContext, payload: Payload) -> Params:
        return ctx.fresh_params()

    def client_eval_params(self, ctx: ClientContext, payload: Payload) -> Params:
        return ctx.fresh_params()  # B = 0: the merged base alone

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        base = state.buffers.setdefault("base", {})
        stacks = stacked_factors(results, scales(state.meta))
        dtype = next(iter(results[0].upload.params.values())).dtype
        sent = 0
        for m, (b, a) in stacks.items():
            delta = (b @ a).to(dtype)
            base[m] = base[m] + delta if m in base else delta
            sent += (b.numel() + a.numel()) * torch.empty((), dtype=dtype).element_size()
        state.meta["version"] = rnd
        state.meta["bytes_down"] = sent
        stacked_rank = next(iter(stacks.values()))[1].shape[0] if stacks else 0  # Σ_k r_k
        return state, Report(metrics={"flora_stacked_rank": float(stacked_rank)})
