"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning"),
option II control variates.

Client k, starting from θ_g with server variate c and its own c_k, trains with the
gradient corrected by (c − c_k): the loss gains ⟨c − c_k, θ⟩, whose gradient is exactly
that correction. After K local steps at learning rate η:

    c_k⁺ = c_k − c + (θ_g − θ_k) / (K η)        (option II)

and it uploads θ_k and Δc_k = c_k⁺ − c_k. The server, over the sampled set S of N clients:

    θ_g ← θ_g + η_g · mean_S(θ_k − θ_g),    c ← c + |S|/N · mean_S(Δc_k)

Option II derives c_k from plain SGD steps: use ``train.optimizer: sgd`` for the method
as published (with Adam the correction still applies, the variate is then approximate).
For the same reason gradient clipping is off by default for SCAFFOLD (``train.grad_clip``
defaults to none here, 1.0 elsewhere): option II reads the mean corrected gradient off
θ_g − θ_k = Kη·mean(g + c − c_k), which a clipped step no longer satisfies, so the new
variate would be biased. A config may still set ``grad_clip`` explicitly.
"""

from __future__ import annotations

from pydantic import Field

from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams
from fedsweep.algorithms.tensors import Params, clone
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientInfo, ClientResult, PLAIN, Payload,
                                       Report, ServerContext, ServerState, Upload)
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch

C, CK, DC = "c/", "ck/", "dc/"


class ScaffoldParams(HyperParams):
    server_lr: float = Field(1.0, gt=0, description="global step size η_g")


@register
class Scaffold(Algorithm):
    name = "scaffold"
    Params = ScaffoldParams
    summary = "control variates correct client drift (option II)"
    capabilities = Capabilities(averages_uploads=True)
    config_defaults = {"train.grad_clip": None}  # option II needs unclipped steps (module docstring)

    def init(self, params: Params, ctx: ServerContext) -> ServerState:
        return ServerState(globals=clone(params), buffers={"c": {k: torch.zeros_like(v) for k, v in params.items()}},
                           meta={"num_clients": len(ctx.clients)})

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        payload = Payload(params=state.globals, tensors={C + k: v for k, v in state.buffers["c"].items()})
        return {cid: payload for cid in sampled}

    def _variates(self, ctx: ClientContext, params: Params) -> tuple[dict, dict]:
        c = {k: ctx.payload.tensors[C + k] for k in params}
        ck = {k: ctx.state.get(CK + k, torch.zeros_like(c[k])) for k in params}
        return c, ck

    def client_loss(self, ctx: ClientContext, loss: torch.Tensor, params: Params) -> torch.Tensor:
        c, ck = self._variates(ctx, params)
        return loss + sum(((c[k] - ck[k]).to(p.device, p.dtype) * p).sum() for k, p in params.items())

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        glob = ctx.payload.params
        c, ck = self._variates(ctx, params)
        scale = 1.0 / (ctx.steps * ctx.learning_rate)
        dc = {}
        for k in params:
            new = ck[k] - c[k] + (glob[k] - params[k]) * scale
            dc[DC + k] = new - ck[k]
            ctx.state[CK + k] = new
        return Upload(params=params, tensors=dc)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        s = len(results)
        n = max(state.meta.get("num_clients", s), s)
        glob, c = state.globals, state.buffers["c"]
        avg = ctx.mean([r.upload.params for r in results], [1.0] * s)  # x + η_g · mean_k (y_k − x)
        state.globals = {k: glob[k] + self.hp.server_lr * (avg[k] - glob[k]) for k in glob}
        state.buffers["c"] = {k: c[k] + (s / n) * torch.stack([r.upload.tensors[DC + k] for r in results]).mean(0)
                              for k in c}
        return state, Report()
