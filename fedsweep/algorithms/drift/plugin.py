"""DRIFT-SP and DRIFT-MST: graph-based personalised LoRA aggregation.

Paper: "United Yet Distinct: Domain Preservation via Divergence Reduction".

Each round the server builds the complete client graph weighted by symmetric KL
divergence (eq. 6–8; by default one distribution per client over all its adapter
tensors, eq. 8 read literally — ``scope: tensor`` sums per-tensor divergences), finds for every sampled client its aggregation set — its MST
neighbours (DRIFT-MST, eq. 10) or the clients on the δ-chosen Dijkstra path (DRIFT-SP,
eq. 11–13) — and returns to each client θ_k ← ρ̂_k θ_k + Σ_{j∈N(k)} ρ̂_j θ_j with
inverse-divergence weights (eq. 14). All K personalised sets come from one (K×K)·(K×n)
product per tensor. See ``graph`` for the pieces.
"""

from __future__ import annotations

import io
import time
from typing import Literal

from pydantic import Field

import fedsweep.algorithms.drift.divergence as dv
import fedsweep.algorithms.drift.graph as dg
from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams
from fedsweep.algorithms.types import AggregationContext, ClientResult, PLAIN, Payload, Report, ServerState
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch


class DriftParams(HyperParams):
    variant: Literal["sp", "mst"] = Field("sp", description="shortest path (δ rule) or minimum spanning tree")
    delta: float = Field(0.2, ge=0, le=1, description="divergence threshold δ of DRIFT-SP (eq. 13)")
    scope: Literal["client", "tensor"] = Field(
        "client", description="client: one softmax over all of a client's adapter tensors (eq. 8, literal); "
                              "tensor: one per adapter tensor, divergences summed")
    eps: float = Field(1e-20, gt=0, description="floor on divergences so inverse weights stay finite (identical "
                                                "clients get exactly this; well below the divergences of clients "
                                                "that differ by 1e-6, about 1e-13)")
    artifacts: bool = Field(True, description="log the divergence matrix (CSV) and the client graph (PNG) each round")


@register
class Drift(Algorithm):
    name = "drift"
    capabilities = Capabilities(personalized=True)
    Params = DriftParams
    summary = "graph-based personalised aggregation: MST neighbours or δ-selected shortest paths"

    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        shared = Payload(params=state.globals)  # clients never aggregated yet start from θ_0
        return {cid: Payload(params=state.personal[cid]) if cid in state.personal else shared for cid in sampled}

    def select(self, d: torch.Tensor) -> list[dg.Selection]:
        g = dg.client_graph(d)
        return dg.mst_selection(g) if self.hp.variant == "mst" else dg.sp_selection(g, self.hp.delta)

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        cids = [r.cid for r in results]
        uploads = [r.upload.params for r in results]
        t0 = time.perf_counter()
        first = next(iter(uploads[0].values()))
        # on an accelerator the uploads are flattened once, for the divergences and the mix
        flat = dg.flatten(uploads, first.dtype) if dg.use_dense(first, None) else None
        stats = dv.Stats()
        d = dv.divergence_matrix(uploads, self.hp.eps, self.hp.scope, flat=flat, stats=stats)
        t1 = time.perf_counter()
        selections = self.select(d)
        w = dg.weight_matrix(selections, len(cids))
        t2 = time.perf_counter()
        # the personal sets these results replace are overwritten in place (no fresh memory to fault in)
        personal = dg.mix(uploads, selections, [dg.flat_buffer(state.personal.get(cid)) for cid in cids], flat=flat)
        for i, cid in enumerate(cids):
            state.personal[cid] = personal[i]
        t3 = time.perf_counter()
        report = Report(
            metrics={"drift_divergence_seconds": t1 - t0, "drift_references": float(len(stats.references)),
                     "drift_pairs_fast_pass": float(stats.fast), "drift_kernel_passes": float(stats.kernel_passes),
                     "drift_pairs_per_pair_form": float(stats.per_pair), "drift_graph_seconds": t2 - t1, "drift_mix_seconds": t3 - t2,
                     "drift_neighbours_mean": sum(len(s.neighbours) for s in selections) / len(selections),
                     "drift_detour_ratio": dg.detour_ratio(d),
                     "drift_divergence_mean": float(d[~torch.eye(len(cids), dtype=torch.bool)].mean()) if len(cids) > 1 else 0.0},
            client_metrics={cids[s.source]: {"drift_neighbours": float(len(s.neighbours)),
                                             "drift_self_weight": float(w[s.source, s.source])} for s in selections},
        )
        if self.hp.artifacts:
            report.artifacts["divergence.csv"] = divergence_csv(d, cids)
            report.artifacts["graph.png"] = graph_png(d, selections, cids, self.hp.variant, self.hp.delta, rnd)
        return state, report


def divergence_csv(d: torch.Tensor, cids: list[int]) -> bytes:
    lines = ["client," + ",".join(str(c) for c in cids)]
    lines += [f"{c}," + ",".join(f"{float(v):.6g}" for v in row) for c, row in zip(cids, d)]
    return ("\n".join(lines) + "\n").encode()


def graph_png(d: torch.Tensor, selections: list[dg.Selection], cids: list[int], variant: str, delta: float,
              rnd: int) -> bytes:
    """The client graph (paper Fig. 3–5): all edges faint, MST edges or each client's chosen path bold."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import networkx as nx
    from matplotlib.figure import Figure

    g = dg.client_graph(d)
    pos = nx.circular_layout(g)
    fig = Figure(figsize=(6, 6), dpi=100)
    ax = fig.add_subplot()
    ax.set_axis_off()
    labels = {i: str(c) for i, c in enumerate(cids)}
    nx.draw_networkx_edges(g, pos, ax=ax, edge_color="#cccccc", width=0.6)
    if variant == "mst":
        edges = {tuple(sorted((s.source, j))) for s in selections for j in s.neighbours}
        nx.draw_networkx_edges(g, pos, edgelist=sorted(edges), ax=ax, edge_color="#d62728", width=2.5)
        title = f"DRIFT-MST, round {rnd}: minimum spanning tree"
    else:
        cmap = matplotlib.colormaps["tab10"]
        for s in selections:
            path_edges = list(zip(s.path[:-1], s.path[1:])) if s.path else []
            nx.draw_networkx_edges(g, pos, edgelist=path_edges, ax=ax, width=2.0, edge_color=[cmap(s.source % 10)],
                                   arrows=True, arrowstyle="-|>", arrowsize=12, connectionstyle="arc3,rad=0.08")
        title = f"DRIFT-SP, round {rnd}: each client's chosen path (δ={delta:g})"
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color="#1f77b4", node_size=420)
    nx.draw_networkx_labels(g, pos, labels=labels, ax=ax, font_color="white", font_size=9)
    if len(cids) <= 8:
        nx.draw_networkx_edge_labels(g, pos, ax=ax, font_size=6,
                                     edge_labels={(s, t): f"{float(d[s, t]):.2g}" for s, t in g.edges})
    ax.set_title(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()
