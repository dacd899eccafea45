"""FFA-LoRA (Sun et al. 2024, "Improving LoRA in Privacy-preserving Federated Learning"): A frozen
at the shared random initialisation; only B is trained, uploaded and averaged."""

from __future__ import annotations

from fedsweep.algorithms.base import Algorithm, Capabilities
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientResult, PLAIN, Report, ServerState,
                                       Upload)
from fedsweep.algorithms.registry import register


from fedsweep.algorithms.lora_factors import part


@register
class FFALoRA(Algorithm):
    """FFA-LoRA (Sun et al. 2024): A frozen at the shared random init, only B trained and averaged."""

    name = "ffa_lora"
    capabilities = Capabilities(adapters=("lora",), averages_uploads=True, partial_sums=True)
    summary = "A frozen at a shared init; only B is trained, uploaded and averaged"

    def frozen(self, key: str) -> bool:
        return "lora_A" in key

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        return Upload(params=part(params, "lora_B"))

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        b = ctx.mean([r.upload.params for r in results], [r.num_examples for r in results])
        state.globals = {**state.globals, **b}
        return state, Report()
