"""pFedGPT (pFedGPT: Hierarchically Optimizing LoRA Aggregation Weights …): mixing, features, validation sets, slow start, Ax HBO and its ablations.

Plugin-level tests drive ``client_prepare`` with synthetic LoRA tensors and a cheap
closed-form "validation loss", so every choice can be recomputed independently here.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedsweep.config import validate
from fedsweep.algorithms import registry
from fedsweep.algorithms.types import ClientContext, ClientResult, Payload, Upload
from fedsweep.algorithms.pfedgpt.bayesopt import Observation, best, minimise
from fedsweep.algorithms.pfedgpt import GLOBAL, INIT, PFedGPTParams
from fedsweep.algorithms.pfedgpt.space import (
    cluster_layers,
    layer_features,
    mix,
    module_types,
    stage1_to_clusters,
    weights_per_cluster,
    weights_per_module_type,
)
from fedsweep.algorithms.pfedgpt.validation import (
    most_similar,
    proportional_sample,
    relative_change,
    silhouette_kmeans,
    slow_start_over,
)

from in_process import client_actor

LAYERS, MODULES = 4, ("q_proj", "v_proj")


def lora(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, m in itertools.product(range(LAYERS), MODULES):
        out[f"model.layers.{i}.self_attn.{m}.lora_A.weight"] = torch.randn(4, 16, generator=g) * scale
        out[f"model.layers.{i}.self_attn.{m}.lora_B.weight"] = torch.randn(16, 4, generator=g) * scale
    return out


# ------------------------------------------------------------------------- spaces


def test_module_types_and_layers_from_keys():
    types = module_types(lora(0))
    assert list(types) == list(MODULES)
    assert types["v_proj"] == [f"model.layers.{i}.self_attn.v_proj" for i in range(LAYERS)]


def test_stage1_mix_is_w_local_plus_one_minus_w_global_per_module_type():
    local, glob = lora(1), lora(2)
    w = {"q_proj": 0.2, "v_proj": 0.9}
    out = mix(local, glob, weights_per_module_type(glob, w))
    for key in glob:
        wp = 0.2 if ".q_proj." in key else 0.9
        torch.testing.assert_close(out[key], wp * local[key] + (1 - wp) * glob[key])


def test_stage2_mix_uses_the_weight_of_each_layers_cluster():
    local, glob = lora(1), lora(2)
    cluster_of = {f"model.layers.{i}.self_attn.{m}": f"{m}/c{i % 2}" for i in range(LAYERS) for m in MODULES}
    w = {"q_proj/c0": 0.1, "q_proj/c1": 0.4, "v_proj/c0": 0.7, "v_proj/c1": 1.0}
    out = mix(local, glob, weights_per_cluster(glob, cluster_of, w))
    for key in glob:
        layer = int(key.split(".")[2])
        module = "q_proj" if ".q_proj." in key else "v_proj"
        wc = w[f"{module}/c{layer % 2}"]
        torch.testing.assert_close(out[key], wc * local[key] + (1 - wc) * glob[key])
    # a stage-1 point maps to the cluster space by copying w_p into every cluster of type p
    assert stage1_to_clusters({"q_proj": 0.3, "v_proj": 0.6}, cluster_of) == {
        "q_proj/c0": 0.3, "q_proj/c1": 0.3, "v_proj/c0": 0.6, "v_proj/c1": 0.6}


def test_layer_features_match_a_direct_computation():
    local, glob, local0, glob0 = lora(1), lora(2), lora(3), lora(4)
    feats = layer_features(local, glob, {k: local[k] - local0[k] for k in local},
                           {k: glob[k] - glob0[k] for k in glob})
    for m in MODULES:
        paths, f = feats[m]
        assert f.shape == (LAYERS, 4)
        for i in range(LAYERS):
            a = f"model.layers.{i}.self_attn.{m}.lora_A.weight"
            b = a.replace("lora_A", "lora_B")
            n = lambda k: local[k].numpy().astype(np.float64)  # noqa: E731
            g = lambda k: glob[k].numpy().astype(np.float64)  # noqa: E731
            dl = lambda k: n(k) - local0[k].numpy().astype(np.float64)  # noqa: E731
            dg = lambda k: g(k) - glob0[k].numpy().astype(np.float64)  # noqa: E731
            expected = [np.mean((n(a) - g(a)) ** 2), np.mean((n(b) - g(b)) ** 2),
                        np.mean((dl(a) - dg(a)) ** 2), np.mean((dl(b) - dg(b)) ** 2)]
            assert paths[i] == f"model.layers.{i}.self_attn.{m}"
            np.testing.assert_allclose(f[i], expected, rtol=1e-5)


def test_layers_cluster_by_their_features():
    # layers 0, 2, 5 drift far from the global model, 1, 3, 4 stay close
    x = np.array([[5.0, 5.1, 1, 1], [0.1, 0.1, 0, 0], [5.2, 4.9, 1, 1.1], [0.0, 0.2, 0, 0],
                  [0.1, 0.0, 0.1, 0], [4.8, 5.0, 0.9, 1]])
    paths = [f"l{i}.q_proj" for i in range(6)]
    cluster_of = cluster_layers({"q_proj": (paths, x)}, clusters=2, seed=0)
    groups = {frozenset(p for p in paths if cluster_of[p] == c) for c in set(cluster_of.values())}
    assert groups == {frozenset({"l0.q_proj", "l2.q_proj", "l5.q_proj"}), frozenset({"l1.q_proj", "l3.q_proj", "l4.q_proj"})}
    assert cluster_of["l0.q_proj"] == "q_proj/c0"  # named in order of first appearance
    # identical features cannot form two clusters
    same = cluster_layers({"v_proj": (paths, np.ones((6, 4)))}, clusters=3, seed=0)
    assert set(same.values()) == {"v_proj/c0"}


# -------------------------------------------------------------------- validation


def blobs(k: int, per: int, dim: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, dim)) * 10
    x = np.concatenate([c + rng.normal(scale=0.3, size=(per, dim)) for c in centres])
    return x, np.repeat(np.arange(k), per)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_silhouette_picks_the_true_number_of_blobs(k):
    x, truth = blobs(k, 12, seed=k)
    found, labels = silhouette_kmeans(x, k_max=8, seed=0)
    assert found == k
    # the same partition as the truth, up to label names
    assert len({(a, b) for a, b in zip(truth.tolist(), labels.tolist())}) == k


def test_proportional_sampling_follows_eq_1():
    labels = np.array([0] * 20 + [1] * 12 + [2] * 8)  # |V| = 40
    picked = proportional_sample(labels, ratio=0.5, seed=3)  # T = 20
    counts = np.bincount(labels[picked], minlength=3)
    assert counts.tolist() == [int(np.floor(20 * n / 40)) for n in (20, 12, 8)] == [10, 6, 4]
    assert len(set(picked)) == len(picked) and picked == sorted(picked)
    assert proportional_sample(np.array([0, 1, 2]), ratio=0.1, seed=0) != []  # never empty


def test_validation_pool_items_are_the_most_similar_on_average():
    rng = np.random.default_rng(0)
    unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)  # noqa: E731
    local, pool = unit(rng.normal(size=(5, 6))), unit(rng.normal(size=(30, 6)))
    brute = sorted(range(30), key=lambda j: -np.mean([local[i] @ pool[j] for i in range(5)]))[:7]
    assert most_similar(torch.tensor(local), torch.tensor(pool), 7) == brute


def test_relative_change_and_the_slow_start_condition():
    losses = [4.0, 3.0, 2.0, 1.9]
    # stride-1 windows of 2: L_t = mean(2.0, 1.9), L_{t−1} = mean(3.0, 2.0) (one round earlier)
    assert relative_change(losses, 2) == pytest.approx(abs(1.95 - 2.5) / 2.5)
    assert relative_change(losses[:3], 2) == pytest.approx(abs(2.5 - 3.5) / 3.5)  # window + 1 losses suffice
    assert relative_change(losses[:2], 2) is None
    assert relative_change([3.0, 2.7], 1) == pytest.approx(0.1)
    assert not slow_start_over(losses, rnd=3, window=2, delta_max=0.1, t_max=10)  # still changing fast
    assert slow_start_over(losses + [1.9, 1.88], rnd=4, window=2, delta_max=0.1, t_max=10)  # settled
    assert slow_start_over([5.0], rnd=10, window=2, delta_max=0.1, t_max=10)  # t ≥ T_max
    assert not slow_start_over([5.0], rnd=9, window=2, delta_max=0.1, t_max=10)


# ----------------------------------------------------------------------- Ax / BO


def test_bayesian_optimisation_finds_a_known_optimum_within_budget():
    f = lambda w: (w["a"] - 0.3) ** 2 + (w["b"] - 0.8) ** 2  # noqa: E731
    obs = minimise(["a", "b"], f, trials=10, seed=0)
    assert len(obs) == 10 and not any(o.attached for o in obs)
    assert obs[0].params == {"a": 0.5, "b": 0.5}  # the centre first
    top = best(obs)[0]
    assert top.value < 5e-3 and abs(top.params["a"] - 0.3) < 0.07 and abs(top.params["b"] - 0.8) < 0.07
    # the GP phase improves on the exploration phase (centre + 2 Sobol points)
    assert top.value < min(o.value for o in obs[:3]) / 10
    assert minimise(["a", "b"], f, trials=10, seed=0) == obs  # deterministic in the seed


def test_prior_observations_are_attached_first_and_counted():
    f = lambda w: sum((w[n] - 0.25) ** 2 for n in w)  # noqa: E731
    prior = [Observation({"x": 0.3, "y": 0.3}, f({"x": 0.3, "y": 0.3})),
             Observation({"x": 0.9, "y": 0.1}, f({"x": 0.9, "y": 0.1}))]
    obs = minimise(["x", "y"], f, trials=3, seed=1, prior=prior)
    assert len(obs) == 5 and [o.attached for o in obs] == [True, True, False, False, False]
    assert [o.params for o in obs[:2]] == [p.params for p in prior]


# ----------------------------------------------------------- plugin, synthetic loss

V_HIGH, LABELS = list(range(10)), [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]


def make_ctx(algo, rnd: int, glob, local, state, meta, target_low, target_high, calls=None):
    def pool_loss(params, indices):
        if calls is not None:
            calls.append(list(indices))
        target = target_high if indices == V_HIGH else target_low
        return float(sum(((params[k] - target[k]) ** 2).mean() for k in sorted(params)))  # (whatever the sets' order)

    return ClientContext(cid=0, rnd=rnd, num_examples=10, local_params=local, state=state, payload=Payload(params=glob),
                         meta=meta, pool_loss=pool_loss, seed=123)


def warm_client(algo, glob, local, meta_extra=None):
    """A client that trained once: state holds the previous global and start."""
    prev = lora(9, 0.5)
    state = {**{GLOBAL + k: prev[k] for k in prev}, **{INIT + k: prev[k] for k in prev}}
    meta = {"v_high": V_HIGH, "v_high_labels": LABELS, "losses": [3.0], **(meta_extra or {})}
    return state, meta


def run_prepare(hp: dict, target_low=None, target_high=None, calls=None):
    algo = registry.create("pfedgpt", {"slow_start": False, "stage1_trials": 4, "stage2_trials": 3, "top_k": 2, **hp})
    glob, local = lora(1), lora(2)
    # a target between local and global: the best mix is w = 0.7 for q and 0.2 for v
    target = mix(local, glob, weights_per_module_type(glob, {"q_proj": 0.7, "v_proj": 0.2}))
    state, meta = warm_client(algo, glob, local)
    ctx = make_ctx(algo, 2, glob, local, state, meta, target_low or target, target_high or target, calls)
    start = algo.client_prepare(ctx, Payload(params=glob))
    return algo, ctx, start, glob, local


def test_hbo_stage1_then_warm_started_stage2_then_top_k_on_v_high():
    calls = []
    algo, ctx, start, glob, local = run_prepare({}, calls=calls)
    h = ctx.meta["hbo"]
    assert len(h["stage1"]) == 4
    assert len(h["stage2"]) == 4 + 3  # the stage-1 observations attached, then 3 new trials
    attached = [o for o in h["stage2"] if o["attached"]]
    assert len(attached) == 4 and not any(o["attached"] for o in h["stage2"][4:])
    s1_best = min(h["stage1"], key=lambda o: o["value"])
    # trial 0 of stage 2 is the stage-1 optimum in the cluster space
    assert h["stage2"][0]["params"] == stage1_to_clusters(s1_best["params"], h["clusters"])
    assert h["stage2"][0]["value"] == s1_best["value"]
    assert sorted(o["value"] for o in attached) == sorted(o["value"] for o in h["stage1"])
    # multi-fidelity: the top-2 by V_low loss re-scored on V_high, the best one starts training
    top = sorted(range(len(h["stage2"])), key=lambda i: (h["stage2"][i]["value"], i))[:2]
    assert [t["params"] for t in h["top_k"]] == [h["stage2"][i]["params"] for i in top]
    chosen = min(h["top_k"], key=lambda t: t["high"])["params"]
    assert h["chosen"] == chosen
    expected = mix(local, glob, weights_per_cluster(glob, h["clusters"], chosen))
    for k in glob:
        torch.testing.assert_close(start[k], expected[k])
    # evaluations: 4 + 3 on V_low (attached trials are not re-evaluated), 2 on V_high
    v_low = ctx.meta["v_low"]  # this round's draw (eq. 1): 3 of V_high, from both clusters
    assert v_low == sorted(v_low) and len(v_low) == 2 and {LABELS[i] for i in v_low} == {0, 1}
    assert sum(c == v_low for c in calls) == 7 and sum(c == V_HIGH for c in calls) == 2
    # the client remembers what it started from and what it received, for the next features
    torch.testing.assert_close(ctx.state[INIT + next(iter(glob))], start[next(iter(glob))])
    assert ctx.meta["round_info"]["hbo"] == 1.0 and ctx.meta["round_info"]["hbo_seconds"] > 0


def test_a_groups_searches_advanced_in_step_make_each_clients_trials_and_pick():
    """Three clients of a training group (different locals, targets and seeds; one still in its slow start)
    through ``client_prepare_group``: every step's candidates of every searching client scored in one call
    of ``tools.losses``, and each client's trials, values, clusters, top-k and pick exactly those of its
    ``client_prepare`` alone (the independent computation: the same search, one candidate at a time)."""
    from fedsweep.algorithms.types import GroupTools

    algo = registry.create("pfedgpt", {"slow_start": True, "t_max": 2, "stage1_trials": 4, "stage2_trials": 3,
                                       "top_k": 2})

    def clients():
        out, glob = [], lora(1)  # one θ_g, as the server sends it (one payload object)
        for c in range(3):
            local = dict(reversed(list(lora(2 + c).items())))  # (the engine's key order need not be θ_g's)
            target = mix(local, glob, weights_per_module_type(glob, {"q_proj": 0.3 + 0.2 * c, "v_proj": 0.6 - 0.2 * c}))
            state, meta = warm_client(algo, glob, local, {"slow_start_over": c != 1})
            ctx = make_ctx(algo, 2 if c != 1 else 1, glob, local, state, meta, target, target)
            ctx.seed = 123 + c
            ctx.payload = out[0].payload if out else ctx.payload
            out.append(ctx)
        return out

    alone = clients()
    starts_alone = [algo.client_prepare(ctx, ctx.payload) for ctx in alone]
    passes = []

    def row_losses(owners, sets, on):  # the synthetic loss of each mix, as the actor's one pass would score them
        passes.append(sorted(set(owners)))
        return [together[c].pool_loss(params, where) for c, params, where in zip(owners, sets.sets(), on)]

    together = clients()
    starts = algo.client_prepare_group(together, [c.payload for c in together],
                                       GroupTools(None, None, row_losses=row_losses))
    assert alone[1].meta["round_info"]["hbo"] == 0.0  # client 1 still starts from θ_g: no search
    assert len(passes) == 4 + 3 + 1 and all(p == [0, 2] for p in passes)  # one pass a step, both searching clients
    for a, b, sa, sb in zip(alone, together, starts_alone, starts):
        assert b.meta.get("hbo") == a.meta.get("hbo") and b.meta["mix_weights"] == a.meta["mix_weights"]
        for k in sa:  # the start, and what the client keeps of it and of θ_g for the next round's features
            assert torch.equal(sb[k], sa[k]) and torch.equal(b.state[INIT + k], a.state[INIT + k])
            assert torch.equal(b.state[GLOBAL + k], a.state[GLOBAL + k])
    info = together[0].meta["round_info"]
    assert info["hbo_seconds"] == pytest.approx(info["hbo_fit_seconds"] + info["hbo_eval_seconds"])


def test_hbo_gets_close_to_the_best_mix():
    algo, ctx, start, glob, local = run_prepare({"stage1_trials": 8, "stage2_trials": 2, "top_k": 1})
    s1 = min(ctx.meta["hbo"]["stage1"], key=lambda o: o["value"])["params"]
    assert abs(s1["q_proj"] - 0.7) < 0.1 and abs(s1["v_proj"] - 0.2) < 0.1


def test_multi_fidelity_can_overrule_the_low_fidelity_ranking():
    glob, local = lora(1), lora(2)
    low = mix(local, glob, weights_per_module_type(glob, {"q_proj": 0.9, "v_proj": 0.9}))
    high = mix(local, glob, weights_per_module_type(glob, {"q_proj": 0.1, "v_proj": 0.1}))
    algo, ctx, start, glob, local = run_prepare({"top_k": 7}, target_low=low, target_high=high)
    h = ctx.meta["hbo"]
    by_low = min(h["stage2"], key=lambda o: o["value"])["params"]
    assert h["chosen"] != by_low  # V_high prefers smaller weights than V_low does
    assert np.mean(list(h["chosen"].values())) < np.mean(list(by_low.values()))


@pytest.mark.parametrize("stages,fidelity", [("stage1", "low"), ("stage1", "high"), ("stage2", "low"),
                                             ("stage2", "high"), ("both", "high"), ("both", "low")])
def test_ablation_switches(stages, fidelity):
    calls = []
    algo, ctx, start, glob, local = run_prepare({"stages": stages, "fidelity": fidelity}, calls=calls)
    h = ctx.meta["hbo"]
    budget = 4 + 3
    if stages == "stage1":
        assert len(h["stage1"]) == budget and "stage2" not in h
    elif stages == "stage2":
        assert "stage1" not in h and len(h["stage2"]) == budget and not any(o["attached"] for o in h["stage2"])
    else:
        assert len(h["stage1"]) == 4 and len(h["stage2"]) == 7
    assert "top_k" not in h  # one fidelity throughout: no re-scoring
    used = V_HIGH if fidelity == "high" else ctx.meta["v_low"]
    assert all(c == used for c in calls) and len(calls) == budget
    final = h["stage2" if stages != "stage1" else "stage1"]
    assert h["chosen"] == min(final, key=lambda o: o["value"])["params"]


def test_slow_start_keeps_the_global_start_until_the_loss_settles():
    algo = registry.create("pfedgpt", {"slow_start": True, "window": 1, "delta_max": 0.05, "t_max": 6,
                                       "stage1_trials": 2, "stage2_trials": 1, "top_k": 1})
    glob, local = lora(1), lora(2)
    state, meta = warm_client(algo, glob, local)
    meta["losses"] = [4.0, 3.0]  # Δ = 0.25 ≥ δ_max: keep starting from θ_g
    ctx = make_ctx(algo, 3, glob, local, state, meta, glob, glob)
    start = algo.client_prepare(ctx, Payload(params=glob))
    assert all(torch.equal(start[k], glob[k]) for k in glob) and "hbo" not in meta
    assert meta["round_info"]["hbo"] == 0.0 and not meta["slow_start_over"]
    meta["losses"] += [2.95]  # Δ = 0.05/3 < δ_max: HBO from now on, for good
    ctx = make_ctx(algo, 4, glob, local, state, meta, glob, glob)
    start = algo.client_prepare(ctx, Payload(params=glob))
    assert meta["slow_start_over"] and meta["slow_start_ended_round"] == 4 and "hbo" in meta
    meta["losses"] += [1.0]  # a jump later does not restart the slow start
    ctx = make_ctx(algo, 5, glob, local, state, meta, glob, glob)
    algo.client_prepare(ctx, Payload(params=glob))
    assert meta["round_info"]["hbo"] == 1.0
    # a client that never trained starts from θ_g even with the slow start off
    fresh = registry.create("pfedgpt", {"slow_start": False})
    meta2 = {"v_high": V_HIGH, "v_high_labels": LABELS}
    start = fresh.client_prepare(make_ctx(fresh, 7, glob, local, {}, meta2, glob, glob), Payload(params=glob))
    assert all(torch.equal(start[k], glob[k]) for k in glob) and "hbo" not in meta2


def test_validation_sets_from_embeddings():
    algo = registry.create("pfedgpt", {"validation_size": 12, "sample_ratio": 0.5})
    x, truth = blobs(3, 10, dim=6, seed=4)
    unit = torch.tensor(x / np.linalg.norm(x, axis=1, keepdims=True))
    pool_texts = [f"p{i}" for i in range(30)]
    table = {t: unit[i] for i, t in enumerate(pool_texts)}
    # the client's data sits on blobs 0 and 1: V_high is their 12 items nearest on average
    local_texts = ["p0", "p1", "p12"]
    ctx = ClientContext(cid=0, rnd=1, num_examples=3, local_params={}, state={}, payload=Payload(),
                        local_texts=local_texts, pool_texts=pool_texts, seed=5,
                        embed=lambda texts: torch.stack([table[t] for t in texts]))
    algo.build_validation_sets(ctx)
    local = unit[[0, 1, 12]].numpy()
    expected = sorted(range(30), key=lambda j: (-np.mean([local[i] @ unit[j].numpy() for i in range(3)]), j))[:12]
    assert ctx.meta["v_high"] == expected  # brute-force mean cosine ranking
    algo.draw_v_low(ctx)
    assert set(ctx.meta["v_low"]) <= set(expected) and 1 <= len(ctx.meta["v_low"]) <= 6
    # V_low is drawn anew each round (Algorithm 1, line 6): the seed carries (seed, round, client)
    draws = set()
    for seed in range(8):
        ctx.seed = seed
        algo.draw_v_low(ctx)
        first = list(ctx.meta["v_low"])
        algo.draw_v_low(ctx)
        assert ctx.meta["v_low"] == first  # deterministic in the seed
        labels = np.asarray(ctx.meta["v_high_labels"])
        counts = {c: int((labels == c).sum()) for c in set(labels.tolist())}
        drawn = [labels[ctx.meta["v_high"].index(i)] for i in first]
        for c, n_c in counts.items():  # eq. (1): ⌊T·N_c/|V|⌋ per cluster, T = ⌊0.5·12⌋
            assert drawn.count(c) == int(np.floor(6 * n_c / 12))
        draws.add(tuple(first))
    assert len(draws) > 1
    # the silhouette search finds as many clusters as V_high holds true blobs
    assert ctx.meta["validation_clusters"] == len(set(truth[expected].tolist()))


def test_overhead_share_is_hbo_time_over_client_round_time():
    algo = registry.create("pfedgpt", {})
    glob = lora(1)
    results = [ClientResult(cid, 10, Upload(params=lora(cid + 2)), {"hbo_seconds": h, "train_seconds": t, "hbo": 1.0})
               for cid, (h, t) in enumerate([(1.0, 10.0), (0.0, 30.0)])]
    from fedsweep.algorithms.types import ServerState

    state, report = algo.aggregate(2, results, ServerState(globals=glob, meta={"hbo_seconds_total": 3.0,
                                                                              "client_seconds_total": 20.0}))
    assert report.metrics["hbo_share"] == pytest.approx(1.0 / 40.0)
    assert report.metrics["hbo_share_run"] == pytest.approx((3.0 + 1.0) / (20.0 + 40.0))  # earlier rounds count
    assert report.client_metrics[0]["hbo_share"] == pytest.approx(0.1)
    for k in glob:  # FedAvg of the uploads (equal sizes)
        torch.testing.assert_close(state.globals[k], (lora(2)[k] + lora(3)[k]) / 2)


def test_config_defaults_and_refusals():
    hp = PFedGPTParams()
    assert (hp.stages, hp.fidelity, hp.slow_start) == ("both", "multi", True)
    from fedsweep.config import ConfigError, validate

    with pytest.raises(ConfigError, match="holdout_fraction"):
        validate({"name": "x", "algorithm": "pfedgpt", "data": {"holdout_fraction": 0}})
    with pytest.raises(ConfigError, match="lora"):
        validate({"name": "x", "algorithm": "pfedgpt", "adapter": "reft"})


# ------------------------------------------------------- ClientActor, tiny model


def test_client_actor_runs_hbo_and_its_state_survives_save_and_restore(tmp_path):
    from fedsweep.algorithms.types import ServerState
    from fedsweep.data import bundled
    from fedsweep.data.partition import make_clients, split_holdout

    cfg = {"name": "t", "seed": 0, "algorithm": "pfedgpt", "lora": {"r": 4},
           "clients": {"num_clients": 2}, "train": {"steps": 3, "batch_size": 4, "learning_rate": 0.01},
           "pfedgpt": {"slow_start": False, "stage1_trials": 2, "stage2_trials": 2, "top_k": 2,
                       "validation_size": 8}}
    recs = bundled.generate(["basic_arithmetic", "spell_backward"], 20, 0)
    rest, pool = split_holdout(recs, 0.3, np.random.default_rng(0))
    hosted = [dict(cid=c.cid, train=c.train, test=c.test) for c in make_clients(rest, "task", 2, seed=0, test_fraction=0.2)]
    actor = client_actor(validate(cfg), hosted, None, pool)
    algo = registry.create("pfedgpt", cfg["pfedgpt"])
    glob = actor.initial_params()
    for rnd in (1, 2):
        results = [actor.train(rnd, cid, Payload(params=glob)) for cid in (0, 1)]
        state, report = algo.aggregate(rnd, results, ServerState(globals=glob))
        glob = state.globals
    first = [r.metrics for r in results]
    assert all(m["hbo"] == 1.0 and m["hbo_seconds"] > 0 for m in first)
    assert 0 < report.metrics["hbo_share"] < 1
    meta = actor.slots[0].algo_meta
    assert len(meta["v_high"]) == 8 and set(meta["v_low"]) <= set(meta["v_high"]) and len(meta["losses"]) == 2
    # the pool items most similar to a client's data come mostly from its own task
    tasks = [pool[i]["task"] for i in meta["v_high"]]
    assert tasks.count(actor.slots[0].train[0]["task"]) > len(tasks) / 2

    actor.save(str(tmp_path))
    (tmp_path / "COMPLETE").write_text('{"round": 2}')
    restored = client_actor(validate(cfg), hosted, None, pool)
    restored.restore(str(tmp_path))
    assert restored.slots[0].algo_meta == meta
    assert restored.slots[0].algo_state.keys() == actor.slots[0].algo_state.keys()
    ra, rb = actor.train(3, 0, Payload(params=glob)), restored.train(3, 0, Payload(params=glob))
    assert actor.slots[0].algo_meta["hbo"] == restored.slots[0].algo_meta["hbo"]
    for k in ra.upload.params:
        torch.testing.assert_close(ra.upload.params[k], rb.upload.params[k], rtol=0, atol=1e-6)


def test_pfedgpt_end_to_end_logs_its_overhead(ray_session, smoke_raw, tracking_uri):
    from mlflow.tracking import MlflowClient

    from fedsweep import checkpoint as ckpt
    from fedsweep.config import validate
    from fedsweep.orchestrator.runner import run

    smoke_raw["algorithm"] = "pfedgpt"
    smoke_raw["pfedgpt"] = {"slow_start": True, "t_max": 2, "stage1_trials": 2, "stage2_trials": 2, "top_k": 2,
                            "validation_size": 6}
    outcome = run(validate(smoke_raw))
    client = MlflowClient(tracking_uri)
    assert client.get_run(outcome.run_id).info.status == "FINISHED"
    share = [m.value for m in client.get_metric_history(outcome.run_id, "hbo_share")]
    assert share[0] == 0.0 and 0.0 < share[1] < 1.0  # round 1: slow start; round 2: t ≥ T_max
    assert [m.value for m in client.get_metric_history(outcome.run_id, "client/002/hbo")] == [0.0, 1.0]
    last = ckpt.latest(outcome.run_dir / "checkpoints")
    saved = ckpt.read_json(last / "client_00001.json")["algo_meta"]
    assert saved["slow_start_ended_round"] == 2 and len(saved["hbo"]["stage2"]) == 4


# ------------------------------------------------------- §4.3 global change: the mean of the clients' changes


def test_uploaded_mixing_weights_rebuild_the_start_exactly():
    algo, ctx, start, glob, local = run_prepare({})
    up = algo.client_upload(ctx, local)
    w = up.tensors["mix_weights"]
    keys = sorted(glob)
    assert w.dtype == torch.float64 and len(w) == len(keys)
    rebuilt = {k: float(x) * local[k] + (1 - float(x)) * glob[k] for k, x in zip(keys, w.tolist())}
    for k in keys:
        assert torch.equal(rebuilt[k], start[k])


def test_server_global_change_is_the_mean_of_the_clients_own_changes():
    from fedsweep.algorithms.types import ServerState

    algo = registry.create("pfedgpt")
    keys = sorted(lora(0))
    glob_old = lora(1)
    prev = {0: lora(2), 1: lora(3), 2: lora(4)}  # the clients' previous uploads (their θ_local)
    weights = {0: [0.7] * len(keys), 1: [0.0] * len(keys), 2: np.linspace(0.1, 0.9, len(keys)).tolist()}
    trained = {c: lora(10 + c) for c in prev}
    state = ServerState(globals={k: v.clone() for k, v in glob_old.items()},
                        buffers={f"last.{c}": p for c, p in prev.items()})
    results = [ClientResult(c, 5 + c, Upload(params=trained[c], tensors={"mix_weights": torch.tensor(weights[c],
                                                                                                   dtype=torch.float64)}))
               for c in prev]
    state, _ = algo.aggregate(2, results, state)
    # by hand, in float64 numpy: θ_init,k = w θ_local + (1 − w) θ_g; Δθ^g = (1/m) Σ (θ_k − θ_init,k)
    for i, key in enumerate(keys):
        changes_k = []
        for c in prev:
            w = weights[c][i]
            init = w * prev[c][key].double().numpy() + (1 - w) * glob_old[key].double().numpy()
            changes_k.append(trained[c][key].double().numpy() - init)
        np.testing.assert_allclose(state.buffers["global_change"][key].double().numpy(), np.mean(changes_k, 0),
                                   rtol=1e-5, atol=1e-6)
    # not the change of θ_g, which also carries the clients' personalised starts
    key = keys[0]
    assert not torch.allclose(state.buffers["global_change"][key], state.globals[key] - glob_old[key], atol=1e-3)
    # it goes down with θ_g to every client, counted in the bytes
    from fedsweep.algorithms.tensors import tensor_bytes
    from fedsweep.algorithms.types import payload_bytes

    p = algo.dispatch(3, [0, 2], state)
    assert p[0] is p[2] and all(torch.equal(p[0].tensors["global_change/" + k], state.buffers["global_change"][k])
                                for k in keys)
    assert payload_bytes(p[0]) == 2 * tensor_bytes(state.globals)
    # the clients' uploads are kept for the next round's rebuild
    assert all(torch.equal(state.buffers[f"last.{c}"][k], trained[c][k]) for c in prev for k in keys)


def test_stage2_features_use_the_broadcast_mean_change():
    algo, ctx, start, glob, local = run_prepare({})
    change = {k: torch.full_like(v, 0.01) for k, v in glob.items()}
    state, meta = warm_client(algo, glob, local)
    payload = Payload(params=glob, tensors={"global_change/" + k: v for k, v in change.items()})
    ctx2 = make_ctx(algo, 2, glob, local, state, meta, glob, glob)
    ctx2.payload = payload
    prev_init = {k: state[INIT + k].clone() for k in glob}
    algo.client_prepare(ctx2, payload)
    feats = ctx2.meta["hbo"]["features"]
    expected = layer_features(local, glob, {k: local[k] - prev_init[k] for k in local}, change)
    for t, (_, f) in expected.items():
        np.testing.assert_allclose(np.array(feats[t]), f, rtol=1e-6)


def test_shipped_configs_let_the_loss_condition_end_the_slow_start_before_t_max():
    """With stride-1 windows of w rounds, Δ_t exists from round w + 2 on: T_max must come later, and the
    run must reach round w + 2, or the δ_max condition can never fire."""
    from pathlib import Path

    from fedsweep.config import load_config, validate
    from fedsweep.config.sweep import load_sweep, trial_raw

    root = Path(__file__).resolve().parents[1] / "configs"
    cfgs = [load_config(root / "experiments" / "pfedgpt.yaml")]
    for name in ("pfedgpt_ablation.yaml", "main.yaml"):
        sweep, base = load_sweep(str(root / "sweeps" / name))
        for variant in sweep.variants or {}:
            cfg = validate(trial_raw(base, sweep, {"variant": variant, "seed": sweep.seeds[0]}))
            if cfg.algorithm == "pfedgpt":
                cfgs.append(cfg)
    assert len(cfgs) >= 3
    for cfg in cfgs:
        hp = cfg.algo_params
        if not hp.slow_start:
            continue
        assert hp.t_max > hp.window + 2 and cfg.rounds >= hp.window + 2, (cfg.name, hp.window, hp.t_max, cfg.rounds)
