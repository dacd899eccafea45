"""Centralized reference row: one client holds the union of all training data.

The runner gives client 0 every client's training split (the others keep only their test
split, so evaluation stays per client). Each round client 0 trains for the step budget of
the whole sampled federation (⌈C·K⌉ × the local steps), and its adapter is the model.
"""

from __future__ import annotations

from fedsweep.algorithms.base import Capabilities
from fedsweep.algorithms.types import AggregationContext, ClientResult, PLAIN, Payload, Report, ServerState
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.registry import register


@register
class Centralized(FedAvg):
    name = "centralized"
    capabilities = Capabilities(centralized=True)
    summary = "one client with the union of training data, same step budget (reference row)"

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        return {0: Payload(params=state.globals, steps_scale=len(sampled))}

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        state.globals = results[0].upload.params
        return state, Report()
