"""FLoRA (Wang et al. 2024): stacking aggregation for heterogeneous LoRA ranks.

Each round the server forms ΔW = Σ_k p_k s_k B_k A_k exactly by stacking the factors (no
cross terms), and the update is merged into the frozen base; clients re-initialise their
LoRA every round. The server keeps the cumulative merged update and sends it versioned:
a ClientActor applies it to its (shared) base once per version, so clients packed on one
base stay consistent, and a client that missed rounds catches up. Bytes down count what
FLoRA transmits in a round: the stacked factors of that round.
"""

from __future__ import annotations

from fedsweep.algorithms.base import (
    BASE_PREFIX,
    Algorithm,
    ClientContext,
    ClientInfo,
    ClientResult,
    Params,
    Payload,
    Report,
    ServerState,
)
from fedsweep.algorithms.lora_stack import stacked_factors
from fedsweep.algorithms.registry import register


@register
class FLoRA(Algorithm):
    adapters = ("lora",)
    name = "flora"
    supports_mixed_ranks = True
    summary = "stacked Σ p_k s_k B_k A_k merged into the base each round; clients re-initialise LoRA"

    def init(self, params: Params, clients: list[ClientInfo]) -> ServerState:
        return ServerState(meta={"version": 0, "bytes_down": 0, "scales": {str(c.cid): c.lora_scale for c in clients}})

    def _payload(self, state: ServerState) -> Payload:
        return Payload(tensors={BASE_PREFIX + m: d for m, d in state.buffers.get("base", {}).items()},
                       data={"base_version": state.meta["version"], "bytes_down": state.meta["bytes_down"]})

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        payload = self._payload(state)
        return {cid: payload for cid in sampled}

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return self._payload(state)

    def client_prepare(self, ctx: ClientContext, payload: Payload) -> Params:
        return ctx.fresh_params()

    def client_eval_params(self, ctx: ClientContext, payload: Payload) -> Params:
        return ctx.fresh_params()  # B = 0: the merged base alone

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState) -> tuple[ServerState, Report]:
        scales = {int(c): s for c, s in state.meta["scales"].items()}
        base = state.buffers.setdefault("base", {})
        sent = 0
        for m, (b, a) in stacked_factors(results, scales).items():
            delta = (b @ a).to(results[0].upload.params[m + ".lora_A.weight"].dtype)
            base[m] = base[m] + delta if m in base else delta
            sent += (b.numel() + a.numel()) * results[0].upload.params[m + ".lora_A.weight"].element_size()
        state.meta["version"] = rnd
        state.meta["bytes_down"] = sent
        return state, Report(metrics={"flora_stacked_rank": float(sum(r.upload.params[next(iter(
            k for k in r.upload.params if k.endswith(".lora_A.weight")))].shape[0] for r in results))})
