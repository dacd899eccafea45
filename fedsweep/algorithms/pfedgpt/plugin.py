"""pFedGPT: hierarchical Bayesian optimisation of local/global LoRA mixing.

Paper: "pFedGPT: Hierarchically Optimizing LoRA Aggregation Weights for Personalized
Federated GPT Models".

Server: n_k-weighted FedAvg of the uploaded LoRA (Algorithm 1, line 16), and the global change
Δθ^g = (1/m) Σ_k Δθ^k of §4.3 — the mean of the m participating clients' own changes
Δθ^k = θ_k − θ_init,k. With the least extra communication: the server keeps each client's last
upload (its θ_local) and θ_g, so a client only uploads its per-tensor mixing weights (one
float per LoRA tensor) and the server rebuilds θ_init,k = w ⊙ θ_local,k + (1 − w) ⊙ θ_g itself;
Δθ^g goes down with θ_g (one more adapter-sized tensor set per payload, counted in
bytes_down). Each client is evaluated with its own (personalised) adapter.

Client, before local training in round t (Algorithm 1, lines 5–10):

1. Once: V_high = the ``validation_size`` pool items nearest its data and its silhouette-chosen
   KMeans clusters; every round V_low is drawn anew from those clusters with ratio
   ``sample_ratio`` (App. B eq. 1, Algorithm 1 line 6), seeded by (seed, round, client).
2. Slow start (§4.5): until Δ_t < δ_max or t ≥ T_max (and always before it has a local
   model), it starts from θ_g; Δ_t compares the current and the previous sliding window of
   the client's per-round training losses, one round apart (stride 1).
3. Stage 1 (§4.2): w_p per module type, θ_agg = w_p θ_local + (1 − w_p) θ_g, minimised with
   Ax on the V_low loss, ``stage1_trials`` evaluations.
4. Stage 2 (§4.3–4.4): layers of each type clustered on F = [δ_A, δ_B, Δ_A, Δ_B], one weight
   per cluster; warm start: the stage-1 optimum is trial 0 and every stage-1 observation,
   mapped into the cluster space (w_c = w_p), is attached as prior data; ``stage2_trials``
   new evaluations.
5. Multi-fidelity: the ``top_k`` best stage-2 points are re-scored on V_high; the best one
   is θ_init for local training.

The clients of an actor that train together run their searches in step (``client_prepare_group``,
:func:`drive`): each step's candidate mixes of all of them are scored in one pass over their
validation rows, while each search keeps its own Ax client, seed and torch generator, so its trials
and its pick are the client's alone.

Ablations (paper Table 4): ``stages: stage1 | stage2`` runs one stage with the whole budget
(stage1_trials + stage2_trials evaluations, so every row evaluates as many points);
``fidelity: low`` keeps V_low throughout (no re-scoring), ``fidelity: high`` uses V_high
throughout (row vi); ``slow_start: false`` starts HBO as soon as a local model exists.

The time spent in HBO is reported per client (``hbo_seconds``: ``hbo_eval_seconds`` computing
validation losses, its share of the group's scoring passes, and ``hbo_fit_seconds`` in Ax, its own
GP fits and acquisitions), as a share of the clients' time in the round
(``hbo_share``) and over the run so far (``hbo_share_run``; the paper reports about 4 % of
the total training time). The share is set by how many validation items HBO scores
(trials × |V_low| + top_k × |V_high|) against how many examples local training processes.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from fedsweep.algorithms.base import Capabilities, HyperParams
from fedsweep.algorithms.tensors import Params, RowSets
from fedsweep.algorithms.types import (AggregationContext, ClientContext, ClientResult, PLAIN, Payload, Report,
                                       ServerState, Upload)
from fedsweep.algorithms.pfedgpt.bayesopt import Observation, Search, best, model_based
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.pfedgpt.space import (
    changes,
    cluster_layers,
    group_layer_features,
    layer_features,
    mix,
    module_types,
    stage1_to_clusters,
    weights_per_cluster,
    weights_per_module_type,
)
from fedsweep.algorithms.pfedgpt.validation import most_similar, proportional_sample, silhouette_kmeans, slow_start_over
from fedsweep.algorithms.registry import register
from fedsweep.lazy import torch

GLOBAL = "global/"
"""Client state: the θ_g it received last time."""
CHANGE = "global_change/"
"""Payload tensors: Δθ^g, the mean of the clients' own changes in the last round (§4.3)."""
LAST = "last."
"""Server buffers: each client's last upload (its θ_local), to rebuild θ_init from mixing weights."""
MIXW = "mix_weights"
"""Upload tensor: the per-tensor mixing weights w of θ_init = w θ_local + (1 − w) θ_g (sorted keys)."""
INIT = "init/"
"""Client state: the θ_init its last local training started from (for the local change Δθ^l)."""


class PFedGPTParams(HyperParams):
    stage1_trials: int = Field(8, ge=1, description="Ax evaluations in the basic space (one weight per module type)")
    stage2_trials: int = Field(8, ge=1, description="new Ax evaluations in the clustered space (after the warm start)")
    top_k: int = Field(3, ge=1, description="best low-fidelity points re-scored on V_high")
    clusters: int = Field(2, ge=1, description="KMeans clusters of the layers of each module type (stage 2)")
    stages: Literal["both", "stage1", "stage2"] = Field("both", description="ablation: run one stage only")
    fidelity: Literal["multi", "low", "high"] = Field(
        "multi", description="multi: optimise on V_low, pick among top_k on V_high; low/high: one set throughout")
    slow_start: bool = Field(True, description="start from θ_g until the loss settles (§4.5)")
    window: int = Field(2, ge=1, description="sliding window (rounds of local training loss) of the slow start; "
                                             "windows one round apart (stride 1)")
    delta_max: float = Field(0.05, gt=0, description="slow start ends when the windows' relative change < δ_max")
    t_max: int = Field(5, ge=1, description="… or at round T_max")
    validation_size: int = Field(32, ge=2, description="n: pool items most similar to the client's data (V_high)")
    sample_ratio: float = Field(0.3, gt=0, le=1, description="ratio of V_high sampled into V_low (App. B eq. 1)")
    max_validation_clusters: int = Field(8, ge=2, description="largest k tried by the silhouette search")
    init_trials: int | None = Field(None, ge=1, description="exploration trials before the GP (default d + 1)")
    encoder: str = Field("all-MiniLM-L6-v2", description="sentence encoder for V_high (bundled name or path)")


@register
class PFedGPT(FedAvg):
    name = "pfedgpt"
    Params = PFedGPTParams
    capabilities = Capabilities(personalized=True, adapters=("lora",), validation_pool=True, client_encoder=True)
    summary = "FedAvg + per-client hierarchical Bayesian optimisation (Ax) of local/global LoRA mixing weights"

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.data.holdout_fraction <= 0:
            raise ValueError("pfedgpt draws its validation sets from the held-out pool: set data.holdout_fraction > 0")

    # ------------------------------------------------------------------ server side
    def dispatch(self, rnd: int, sampled: list[int], state: ServerState) -> dict[int, Payload]:
        change = state.buffers.get("global_change")
        tensors = {CHANGE + k: v for k, v in change.items()} if change else {}
        payload = Payload(params=state.globals, tensors=tensors)  # one object for every client
        return {cid: payload for cid in sampled}

    def global_change(self, results: list[ClientResult], state: ServerState) -> Params:
        """Δθ^g = (1/m) Σ_k (θ_k − θ_init,k) with θ_init,k rebuilt from the client's mixing weights,
        its previous upload and the θ_g it received (``state.globals`` before aggregation)."""
        glob = state.globals
        keys = sorted(glob)
        total = {k: torch.zeros_like(glob[k], dtype=torch.float32) for k in keys}
        for r in results:
            w = r.upload.tensors.get(MIXW)
            prev = state.buffers.get(f"{LAST}{r.cid}")
            if w is not None and prev is not None and bool((w != 0).any()):
                start = mix(prev, glob, {k: float(x) for k, x in zip(keys, w.tolist())})
            else:  # started from θ_g (slow start, or no local model yet)
                start = glob
            for k in keys:
                total[k] += r.upload.params[k].float() - start[k].float()
        return {k: (v / len(results)).to(glob[k].dtype) for k, v in total.items()}

    def aggregate(self, rnd: int, results: list[ClientResult], state: ServerState,
                  ctx: AggregationContext = PLAIN) -> tuple[ServerState, Report]:
        change = self.global_change(results, state)
        state, report = super().aggregate(rnd, results, state)
        state.buffers["global_change"] = change
        for r in results:  # θ_local of the next round
            state.buffers[f"{LAST}{r.cid}"] = {k: v.detach().clone() for k, v in r.upload.params.items()}
        hbo = sum(r.metrics.get("hbo_seconds", 0.0) for r in results)
        total = sum(r.metrics.get("train_seconds", 0.0) for r in results)
        report.metrics["hbo_share"] = hbo / total if total > 0 else 0.0
        report.metrics["hbo_seconds"] = hbo
        # over the whole run so far, as the paper reports it (about 4 % of the total training time)
        state.meta["hbo_seconds_total"] = state.meta.get("hbo_seconds_total", 0.0) + hbo
        state.meta["client_seconds_total"] = state.meta.get("client_seconds_total", 0.0) + total
        report.metrics["hbo_share_run"] = (state.meta["hbo_seconds_total"] / state.meta["client_seconds_total"]
                                           if state.meta["client_seconds_total"] > 0 else 0.0)
        report.metrics["hbo_clients"] = float(sum(r.metrics.get("hbo", 0.0) > 0 for r in results))
        for r in results:
            seconds = r.metrics.get("train_seconds", 0.0)
            report.client_metrics[r.cid] = {"hbo_share": r.metrics.get("hbo_seconds", 0.0) / seconds if seconds else 0.0}
        return state, report

    def eval_payload(self, state: ServerState, cid: int) -> Payload:
        return Payload()  # each client is evaluated with its own adapter

    # ------------------------------------------------------------------ client side
    def client_prepare(self, ctx: ClientContext, payload: Payload) -> Params:
        """θ_init of one client (Algorithm 1, lines 5–10): HBO's scoring one candidate after another
        (``ctx.pool_loss``)."""
        return self.client_prepare_group([ctx], [payload], None)[0]

    def client_prepare_group(self, ctxs: list[ClientContext], payloads: list[Payload], tools) -> list[Params]:
        """θ_init of every client of a training group: their HBO searches advanced in step, each step's
        candidate mixes of all of them computed as one array and scored in one pass (``tools.row_losses``;
        None: each candidate scored alone), their stage-2 features and their starts computed for all of
        them at once. Every search is its own (its Ax client, its seed, its observations), and every mix
        and feature the same numbers as alone: the trials and the picks are each client's alone."""
        t0 = time.perf_counter()
        if any(p.params is None for p in payloads):
            raise ValueError("pfedgpt: the round's payload carries no global adapter")
        globs = [p.params for p in payloads]
        grouped = tools is not None and tools.row_losses is not None and len({id(g) for g in globs}) == 1
        arrays = GroupArrays.of(ctxs, globs[0]) if grouped else None
        features = self._features_of_group(ctxs, globs[0], arrays) if grouped else {}
        runs = {i: self._prepare(ctx, glob, features.get(i)) for i, (ctx, glob) in enumerate(zip(ctxs, globs))}
        chosen = drive(runs, ctxs, globs, tools, arrays)
        starts = self._starts(ctxs, globs, chosen, arrays)
        for ctx in ctxs:
            ctx.meta["round_info"]["prepare_seconds"] = (time.perf_counter() - t0) / len(ctxs)
        return starts

    def _starts(self, ctxs: list[ClientContext], globs: list[Params], chosen: dict, arrays) -> list[Params]:
        """Each client's θ_init (θ_g, or its chosen mix), kept in its state with the θ_g it received."""
        mixed = [i for i in range(len(ctxs)) if chosen[i] is not None]
        grouped = arrays is not None
        if grouped:
            rows = arrays.mix(mixed, [chosen[i] for i in mixed]) if mixed else None
            starts = {i: rows.layout.views(rows.rows[j].clone()) for j, i in enumerate(mixed)}
            kept = {k: v.detach().clone() for k, v in globs[0].items()}  # (one θ_g, every client's copy of it)
        else:
            starts = {i: mix(ctxs[i].local_params, globs[i], chosen[i]) for i in mixed}
        out = []
        for i, (ctx, glob) in enumerate(zip(ctxs, globs)):
            start = starts.get(i, glob)
            for k in glob:
                if grouped:  # (a start's own row, or the one copy of θ_g)
                    ctx.state[GLOBAL + k], ctx.state[INIT + k] = kept[k], start[k] if i in starts else kept[k]
                else:
                    ctx.state[GLOBAL + k], ctx.state[INIT + k] = glob[k].detach().clone(), start[k].detach().clone()
            out.append(start)
        return out

    def _features_of_group(self, ctxs: list[ClientContext], glob: Params, arrays: "GroupArrays") -> dict[int, dict]:
        """Stage 2's layer features (§4.3) of every client that has a local model, as one array
        (:func:`~fedsweep.algorithms.pfedgpt.space.group_layer_features`): index -> features."""
        keys = list(glob)
        have = [i for i, ctx in enumerate(ctxs) if all(GLOBAL + k in ctx.state for k in keys)]
        if not have:
            return {}
        layout = arrays.layout
        if CHANGE + keys[0] in ctxs[have[0]].payload.tensors:  # the broadcast mean change: every client's
            change = layout.rows([{k: ctxs[have[0]].payload.tensors[CHANGE + k] for k in keys}])
        else:  # before any mean change exists: θ_g against the θ_g each client kept
            change = layout.rows([changes(glob, {k: ctxs[i].state[GLOBAL + k] for k in keys}) for i in have])
        prev = layout.rows([{k: ctxs[i].state[INIT + k] for k in layout.shapes} for i in have])
        at = torch.tensor(have)
        out = group_layer_features(layout, arrays.local.index_select(0, at), arrays.glob, prev, change, keys)
        return dict(zip(have, out))

    def _prepare(self, ctx: ClientContext, glob: Params, features: dict | None = None):
        """One client's preparation as a generator (see :func:`drive`): it yields the mixes it needs scored
        (``[(each tensor's weight w, pool indices)]``: θ = w θ_local + (1 − w) θ_g) and is sent their
        losses; it returns the weights of its θ_init's mix (None: θ_g). ``features``: its stage-2 layer
        features where the group computed them."""
        hp = self.hp
        if "v_high" not in ctx.meta:
            self.build_validation_sets(ctx)
        self.draw_v_low(ctx)
        info: dict = {"round": ctx.rnd, "hbo": 0.0, "hbo_seconds": 0.0}
        has_local = any(k.startswith(GLOBAL) for k in ctx.state)
        if has_local and hp.slow_start and not ctx.meta.get("slow_start_over"):
            ctx.meta["slow_start_over"] = slow_start_over(ctx.meta.get("losses", []), ctx.rnd, hp.window,
                                                          hp.delta_max, hp.t_max)
            if ctx.meta["slow_start_over"]:
                ctx.meta["slow_start_ended_round"] = ctx.rnd
        weights = None
        ctx.meta["mix_weights"] = [0.0] * len(glob)
        if has_local and (ctx.meta.get("slow_start_over") or not hp.slow_start):
            weights, info = yield from self.hbo(ctx, glob, features)  # (its seconds: :func:`drive`)
        ctx.meta["round_info"] = info
        return weights

    def build_validation_sets(self, ctx: ClientContext) -> None:
        """V_high and V_low of App. B, once per client, kept as pool indices in the client's state."""
        if not ctx.pool_texts:
            raise ValueError("pfedgpt needs the held-out validation pool (data.holdout_fraction > 0)")
        t0 = time.perf_counter()
        local = ctx.embed(ctx.local_texts)
        pool = ctx.embed(ctx.pool_texts)
        v_high = most_similar(local, pool, self.hp.validation_size)
        k, labels = silhouette_kmeans(pool[v_high].double().numpy(), self.hp.max_validation_clusters, ctx.seed)
        ctx.meta.update(v_high=v_high, v_high_labels=[int(x) for x in labels], validation_clusters=k,
                        validation_seconds=time.perf_counter() - t0)

    def draw_v_low(self, ctx: ClientContext) -> None:
        """V_low of this round (Algorithm 1, line 6): eq. (1) proportional sampling from V_high's
        clusters, seeded by (seed, round, client) through ``ctx.seed``."""
        import numpy as np

        labels = np.asarray(ctx.meta["v_high_labels"])
        ctx.meta["v_low"] = [ctx.meta["v_high"][i] for i in proportional_sample(labels, self.hp.sample_ratio, ctx.seed)]

    def hbo(self, ctx: ClientContext, glob: Params, features: dict | None = None):
        """Stages 1 and 2 and the multi-fidelity choice, as a generator (it yields candidates to score, is
        sent their losses); returns the weights of θ_init's mix and what happened. ``features``: stage 2's
        layer features where the group computed them."""
        hp = self.hp
        local = ctx.local_params
        keys = list(glob)
        opt_set = ctx.meta["v_high"] if hp.fidelity == "high" else ctx.meta["v_low"]
        fits = []  # each search's seconds in Ax (GP fits, acquisition)

        def search(names, weights, trials, seed, prior=()):
            s = Search(names, trials, seed, prior=prior, init_trials=hp.init_trials)
            while not s.done:
                w = s.ask()
                s.tell((yield [(weights(w), opt_set)])[0])
            obs = s.observations()
            fits.append(s.fit_seconds)
            return obs

        budget = hp.stage1_trials + hp.stage2_trials
        history: dict = {"round": ctx.rnd}
        info: dict = {"round": ctx.rnd, "hbo": 1.0}
        if hp.stages in ("both", "stage1"):
            types = sorted(module_types(keys))
            obs = yield from search(types, lambda w: weights_per_module_type(keys, w),
                                    hp.stage1_trials if hp.stages == "both" else budget, ctx.seed)
            history["stage1"] = [o.to_json() for o in obs]
            info.update(stage1_best_loss=best(obs)[0].value, stage1_model_based_trials=float(model_based(obs)))
            weights = lambda w: weights_per_module_type(keys, w)  # noqa: E731
        if hp.stages in ("both", "stage2"):
            prev_init = {k: ctx.state[INIT + k] for k in keys}
            global_change = {k: ctx.payload.tensors[CHANGE + k] for k in keys} if CHANGE + keys[0] in ctx.payload.tensors \
                else changes(glob, {k: ctx.state[GLOBAL + k] for k in keys})  # before any mean change exists
            if features is None:
                features = layer_features(local, glob, changes(local, prev_init), global_change)
            cluster_of = cluster_layers(features, hp.clusters, ctx.seed)
            prior: list[Observation] = []
            if hp.stages == "both":  # warm start: the stage-1 optimum first, then the other observations
                first = best(obs)[0]
                prior = [Observation(stage1_to_clusters(o.params, cluster_of), o.value)
                         for o in [first] + [o for o in obs if o is not first]]
            obs = yield from search(sorted(set(cluster_of.values())), lambda w: weights_per_cluster(keys, cluster_of, w),
                                    hp.stage2_trials if hp.stages == "both" else budget, ctx.seed + 1, prior)
            history.update(stage2=[o.to_json() for o in obs], clusters=cluster_of,
                           features={t: f.tolist() for t, (_, f) in features.items()})
            info.update(stage2_attached=float(len(prior)), stage2_best_loss=best(obs)[0].value,
                        stage2_model_based_trials=float(model_based(obs)),
                        stage2_clusters=float(len(set(cluster_of.values()))))
            weights = lambda w: weights_per_cluster(keys, cluster_of, w)  # noqa: E731
        if hp.fidelity == "multi":  # re-score the top-k on V_high
            candidates = best(obs, hp.top_k)
            scores = yield [(weights(c.params), ctx.meta["v_high"]) for c in candidates]
            pick = min(range(len(candidates)), key=lambda i: (scores[i], i))
            chosen, chosen_loss = candidates[pick], scores[pick]
            history["top_k"] = [{"params": c.params, "low": c.value, "high": s} for c, s in zip(candidates, scores)]
        else:
            chosen = best(obs)[0]
            chosen_loss = chosen.value
        history["chosen"] = chosen.params
        ctx.meta["hbo"] = history
        per_key = weights(chosen.params)
        ctx.meta["mix_weights"] = [float(per_key[k]) for k in sorted(glob)]
        info.update(final_loss=chosen_loss, mix_weight_mean=sum(chosen.params.values()) / len(chosen.params),
                    hbo_fit_seconds=sum(fits))  # the rest of hbo_seconds is the scoring (hbo_eval_seconds)
        return weights(chosen.params), info

    def client_upload(self, ctx: ClientContext, params: Params) -> Upload:
        if ctx.train_loss is not None:
            ctx.meta["losses"] = list(ctx.meta.get("losses", [])) + [ctx.train_loss]
        info = ctx.meta.get("round_info", {})
        metrics = {k: float(v) for k, v in info.items() if k != "round"}
        metrics["prepare_host_seconds"] = metrics.get("hbo_fit_seconds", 0.0)  # (the round's phases: outside the model)
        metrics["slow_start"] = float(self.hp.slow_start and not ctx.meta.get("slow_start_over", False))
        metrics["v_high"] = float(len(ctx.meta.get("v_high", [])))
        metrics["v_low"] = float(len(ctx.meta.get("v_low", [])))
        mixw = torch.tensor(ctx.meta.get("mix_weights") or [0.0] * len(params), dtype=torch.float64)
        return Upload(params=params, tensors={MIXW: mixw}, metrics=metrics)


def drive(runs: dict, ctxs: list[ClientContext], globs: list[Params], tools, arrays: "GroupArrays | None" = None) -> dict:
    """Advance every client's preparation (``runs``: index -> generator, :meth:`PFedGPT._prepare`) to its
    end, in step: each step's mixes of every client still searching computed as one array
    (:func:`mix_rows`) and scored in one pass (``tools.row_losses``), or, without ``tools``, each client's
    one after another (``ctx.pool_loss`` of :func:`~fedsweep.algorithms.pfedgpt.space.mix`). Each
    client's ``hbo_eval_seconds`` is its share of the passes it took part in. Returns index -> θ_init."""
    out, asked, scoring = {}, {}, {i: 0.0 for i in runs}
    for i, run in runs.items():
        _advance(run, None, i, asked, out)
    while asked:
        t0 = time.perf_counter()
        if arrays is None:
            losses = {i: [ctxs[i].pool_loss(mix(ctxs[i].local_params, globs[i], w), on) for w, on in req]
                      for i, req in asked.items()}
        else:
            owners = [i for i, req in asked.items() for _ in req]
            sets = arrays.mix(owners, [w for req in asked.values() for w, _ in req])
            values = iter(tools.row_losses(owners, sets, [on for req in asked.values() for _, on in req]))
            losses = {i: [next(values) for _ in req] for i, req in asked.items()}
        share = (time.perf_counter() - t0) / len(asked)
        for i in asked:
            scoring[i] += share
        current, asked = asked, {}
        for i in current:
            _advance(runs[i], losses[i], i, asked, out)
    for i in runs:
        info = ctxs[i].meta["round_info"]
        if info.get("hbo"):  # its own seconds in Ax, and its share of the scoring
            info["hbo_eval_seconds"] = scoring[i]
            info["hbo_seconds"] = info["hbo_fit_seconds"] + scoring[i]
    return out


class GroupArrays:
    """A training group's θ_local as one (clients, P) array and its θ_g as one row (P,), in the layout of
    the clients' own parameters (made once a round: every HBO step's mixes are computed from them)."""

    def __init__(self, layout, local: torch.Tensor, glob: torch.Tensor):
        self.layout, self.local, self.glob = layout, local, glob

    @classmethod
    def of(cls, ctxs: list[ClientContext], glob: Params) -> "GroupArrays":
        from fedsweep.algorithms.tensors import FlatLayout

        layout = FlatLayout.of_params({k: ctxs[0].local_params[k] for k in ctxs[0].local_params if k in glob})
        keys = list(layout.shapes)
        return cls(layout, layout.rows([{k: c.local_params[k] for k in keys} for c in ctxs]), layout.rows([glob])[0])

    def mix(self, which: list[int], weights: list[dict[str, float]]) -> RowSets:
        """Every mix θ_i = w_i θ_local + (1 − w_i) θ_g as one (N, P) array: row i mixes client ``which[i]``'s
        θ_local and θ_g with the per-tensor weights ``weights[i]``. Element by element
        :func:`~fedsweep.algorithms.pfedgpt.space.mix`'s arithmetic (its coefficients the same float32 numbers)."""
        keys = list(self.layout.shapes)
        sizes = torch.tensor(self.layout.sizes)
        w = torch.tensor([[ws[k] for k in keys] for ws in weights], dtype=torch.float64)
        keep = w.to(self.local.dtype).repeat_interleave(sizes, dim=1)
        rest = (1.0 - w).to(self.local.dtype).repeat_interleave(sizes, dim=1)
        return RowSets(keep * self.local.index_select(0, torch.tensor(which)) + rest * self.glob, self.layout)


def _advance(run, sent, i: int, asked: dict, out: dict) -> None:
    """One step of a client's preparation: what it asks next into ``asked``, or its θ_init into ``out``."""
    try:
        asked[i] = next(run) if sent is None else run.send(sent)
    except StopIteration as done:
        out[i] = done.value
