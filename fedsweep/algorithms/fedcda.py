"""FedCDA (Wang et al. 2024, "FedCDA: Federated Learning with Cross-rounds Divergence-aware Aggregation"): cross-round divergence-aware aggregation.

The server keeps each client's last L uploaded models. Each round it chooses, for every
sampled client, the one of its stored models that minimises the divergence (squared L2
distance) to the other clients' chosen models — coordinate descent from the newest
models, ``sweeps`` passes in client order — and averages the choices weighted by n_k.
Clients with a single stored model contribute that model (the paper's warm-up).
"""

from __future__ import annotations

from pydantic import Field

from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams
from fedsweep.algorithms.tensors import Params, as_vector
from fedsweep.algorithms.types import AggregationContext, ClientResult, PLAIN, Report, ServerState
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch


class FedCDAParams(HyperParams):
    history: int = Field(3, ge=1, description="L: local models kept per client")
    sweeps: int = Field(2, ge=1, description="coordinate-descent passes of the selection")


def flat(p: Params) -> torch.Tensor:
    """A model as one float32 vector, its tensors in key order."""
    return as_vector({k: p[k] for k in sorted(p)}, torch.float32)


def select(candidates: list[torch.Tensor], sweeps: int) -> list[int]:
    """Per client, the index of the candidate (rows of an (L_k, n) tensor) nearest to the others' choices."""
    choice = [len(c) - 1 for c in candidates]  # newest first
    for _ in range(sweeps):
        for k, cand in enumerate(candidates):
            others = [candidates[j][choice[j]] for j in range(len(candidates)) if j != k]
            if not others or len(cand) == 1:
                continue
            cost = torch.stack([((cand - o) ** 2).sum(dim=1) for o in others]).sum(0)
            choice[k] = int(torch.argmin(cost))
    return choice


@register
class FedCDA(Algorithm):
    name = "fedcda"
    Params = FedCDAParams
    summary = "per client, the stored recent model least divergent from the others; then average"
    capabilities = Capabilities(averages_uploads=True)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        candidates, stored = [], []
        for r in results:
            hist = [state.buffers[f"hist.{r.cid}.{i}"] for i in range(state.meta.get(f"hist_len.{r.cid}", 0))]
            hist = (hist + [r.upload.params])[-self.hp.history:]
            stored.append(hist)
            candidates.append(torch.stack([flat(h) for h in hist]))
        choice = select(candidates, self.hp.sweeps)
        chosen = [stored[i][c] for i, c in enumerate(choice)]
        state.globals = ctx.mean(chosen, [r.num_examples for r in results])
        for r, hist in zip(results, stored):
            for i, h in enumerate(hist):
                state.buffers[f"hist.{r.cid}.{i}"] = h
            state.meta[f"hist_len.{r.cid}"] = len(hist)
        older = sum(c != len(s) - 1 for c, s in zip(choice, stored))
        return state, Report(metrics={"fedcda_older_models_chosen": float(older)})
