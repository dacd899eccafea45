"""DRIFT against brute force: enumerated spanning trees and simple paths, scipy's KL."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest
import torch
from scipy.special import softmax
from scipy.stats import entropy

from fedsweep.algorithms import create
from fedsweep.algorithms import drift_graph as dg
from fedsweep.algorithms.base import ClientResult, Upload


def _random_d(k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    m = rng.uniform(0.1, 5.0, size=(k, k))
    m = np.triu(m, 1)
    return torch.tensor(m + m.T)


def _uploads(k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [{"a.lora_A.weight": torch.randn(3, 6, generator=g) * (1 + i),
             "a.lora_B.weight": torch.randn(5, 3, generator=g)} for i in range(k)]


def test_divergence_matrix_matches_scipy_symmetric_kl():
    ups = _uploads(4)
    d = dg.divergence_matrix(ups, eps=1e-12)
    for s, t in itertools.permutations(range(4), 2):
        expected = 0.0
        for key in ups[0]:
            p = softmax(ups[s][key].double().numpy().ravel())
            q = softmax(ups[t][key].double().numpy().ravel())
            expected += entropy(p, q) + entropy(q, p)
        assert float(d[s, t]) == pytest.approx(expected, rel=1e-4)
    assert torch.equal(d, d.T) and torch.all(d.diagonal() == 0)


def test_identical_clients_are_clamped_not_zero():
    ups = _uploads(1) * 3
    d = dg.divergence_matrix(ups, eps=1e-6)
    assert float(d[0, 1]) == 1e-6


def _brute_mst_edges(d: torch.Tensor) -> set[tuple[int, int]]:
    k = d.shape[0]
    edges = list(itertools.combinations(range(k), 2))
    best, best_cost = None, float("inf")
    for tree in itertools.combinations(edges, k - 1):
        g = nx.Graph(tree)
        g.add_nodes_from(range(k))
        if nx.is_connected(g):
            cost = sum(float(d[s, t]) for s, t in tree)
            if cost < best_cost:
                best, best_cost = set(tree), cost
    return best


@pytest.mark.parametrize("seed", range(6))
def test_mst_neighbours_match_brute_force_enumeration(seed):
    d = _random_d(6, seed)
    edges = _brute_mst_edges(d)
    for sel in dg.mst_selection(dg.client_graph(d)):
        expected = sorted({t for s, t in edges if s == sel.source} | {s for s, t in edges if t == sel.source})
        assert sel.neighbours == expected


def _brute_shortest_paths(d: torch.Tensor, source: int) -> dict[int, tuple[float, list[int]]]:
    k = d.shape[0]
    best: dict[int, tuple[float, list[int]]] = {}
    others = [v for v in range(k) if v != source]
    for length in range(1, k):
        for middle in itertools.permutations(others, length):
            path = [source, *middle]
            cost = sum(float(d[a, b]) for a, b in zip(path[:-1], path[1:]))
            t = path[-1]
            if t not in best or cost < best[t][0]:
                best[t] = (cost, path)
    return best


def _rule_from_the_spec(paths: dict[int, tuple[float, list[int]]], delta: float) -> list[int]:
    hops = {t: len(p) - 1 for t, (_, p) in paths.items()}
    total = sum(hops.values())
    ranked = sorted(paths, key=lambda t: (-hops[t], paths[t][0], t))
    for t in ranked:
        if hops[t] / total <= delta:
            return paths[t][1]
    fewest = sorted(paths, key=lambda t: (hops[t], paths[t][0], t))[0]
    return paths[fewest][1]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("delta", [0.0, 0.1, 0.2, 0.35, 0.6, 1.0])
def test_sp_selection_matches_brute_force_paths_and_the_delta_rule(seed, delta):
    d = _random_d(6, 100 + seed)
    for sel in dg.sp_selection(dg.client_graph(d), delta):
        path = _rule_from_the_spec(_brute_shortest_paths(d, sel.source), delta)
        assert sel.path == path
        assert sel.neighbours == path[1:]
        assert sel.entering_edge == {b: float(d[a, b]) for a, b in zip(path[:-1], path[1:])}


@pytest.mark.parametrize("seed", range(8))
def test_larger_delta_never_aggregates_fewer_clients(seed):
    k = 7
    rng = np.random.default_rng(seed)
    # a line-like geometry makes multi-hop shortest paths common
    pts = rng.uniform(0, 1, size=(k, 2)) * [10, 1]
    d = torch.tensor(np.linalg.norm(pts[:, None] - pts[None], axis=-1) ** 2)
    g = dg.client_graph(d)
    sizes = np.array([[len(s.neighbours) for s in dg.sp_selection(g, delta)] for delta in np.linspace(0, 1, 21)])
    assert (np.diff(sizes, axis=0) >= 0).all()
    assert sizes[-1].max() > sizes[0].min()


def test_weights_sum_to_one_and_favour_less_divergent_clients():
    d = _random_d(6, 7)
    for sel in dg.mst_selection(dg.client_graph(d)) + dg.sp_selection(dg.client_graph(d), 0.5):
        w = dg.weights(sel)
        assert sum(w.values()) == pytest.approx(1.0)
        assert w[sel.source] == max(w.values())
        for a, b in itertools.combinations(sel.neighbours, 2):
            if sel.entering_edge[a] < sel.entering_edge[b]:
                assert w[a] > w[b]
        # exact: proportional to inverse divergence, source at 1/min
        inv = {j: 1 / sel.entering_edge[j] for j in sel.neighbours}
        if inv:
            inv[sel.source] = max(inv.values())
            z = sum(inv.values())
            assert all(w[j] == pytest.approx(v / z) for j, v in inv.items())


@pytest.mark.parametrize("variant", ["sp", "mst"])
def test_personalised_parameters_are_the_weighted_neighbour_sums(variant):
    ups = _uploads(5, seed=3)
    algo = create("drift", {"variant": variant, "delta": 0.5, "artifacts": True})
    state = algo.init(ups[0], [])
    cids = [10, 11, 12, 13, 14]
    state, report = algo.aggregate(1, [ClientResult(c, 1, Upload(params=u)) for c, u in zip(cids, ups)], state)
    d = dg.divergence_matrix(ups, algo.hp.eps)
    sels = algo.select(d)
    for sel in sels:
        w = dg.weights(sel)
        for key in ups[0]:
            expected = sum(w[j] * ups[j][key].double() for j in w)
            torch.testing.assert_close(state.personal[cids[sel.source]][key].double(), expected, rtol=1e-5, atol=1e-6)
    assert set(report.artifacts) == {"divergence.csv", "graph.png"}
    assert report.artifacts["graph.png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert report.artifacts["divergence.csv"].decode().splitlines()[0] == "client,10,11,12,13,14"
    # a client's next payload is its own personalised set; unseen clients get θ_0
    payloads = algo.dispatch(2, [10, 99], state)
    assert payloads[10].params is state.personal[10] and payloads[99].params is state.globals


def test_dpo_loss_by_hand():
    from fedsweep.actors.objectives import dpo_loss, sequence_logps

    pc, pr, rc, rr = (torch.tensor(v) for v in ([-1.0, -2.0], [-3.0, -1.0], [-1.5, -2.0], [-2.0, -1.5]))
    loss, margin = dpo_loss(pc, pr, rc, rr, beta=0.2)
    expected_margin = [0.2 * ((-1 + 1.5) - (-3 + 2)), 0.2 * ((-2 + 2) - (-1 + 1.5))]
    torch.testing.assert_close(margin, torch.tensor(expected_margin))
    expected = np.mean([np.log1p(np.exp(-m)) for m in expected_margin])
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    # sequence log-probs: sum over completion positions of log softmax at the next token
    logits = torch.randn(1, 4, 6)
    ids = torch.tensor([[0, 3, 5, 2]])
    mask = torch.tensor([[0, 0, 1, 1]])
    manual = sum(torch.log_softmax(logits[0, t], -1)[ids[0, t + 1]] for t in (1, 2))
    assert float(sequence_logps(logits, ids, mask)) == pytest.approx(float(manual), rel=1e-6)
