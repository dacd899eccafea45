"""Baselines against independent computations: hand-computed FedOpt steps, dense LoRA sums,
numpy's SVD, a quadratic problem with drifting clients, autograd of the proximal term."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedsweep.algorithms.types import ServerContext
import torch

from fedsweep.algorithms import create
from fedsweep.algorithms.types import ClientContext, ClientInfo, ClientResult, Payload, Upload
from fedsweep.algorithms.fedcda import flat, select
from fedsweep.algorithms.fedprox import proximal_term
from fedsweep.config import ConfigError, validate

KEY = "l.q_proj.lora_A.weight"


def _results(rounds=3, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[ClientResult(i, n, Upload(params={KEY: torch.randn(2, 3, generator=g)}))
             for i, n in zip(range(k), [1, 3, 6])] for _ in range(rounds)]


def _avg(rs):
    n = np.array([r.num_examples for r in rs], float)
    return sum(w * r.upload.params[KEY].double().numpy() for w, r in zip(n / n.sum(), rs))


@pytest.mark.parametrize("rule", ["fedadagrad", "fedadam", "fedyogi"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_fedopt_three_rounds_by_hand(rule, bias_correction):
    hp = {"server_lr": 0.1, "beta1": 0.0 if rule == "fedadagrad" else 0.9, "beta2": 0.99, "tau": 1e-3,
          "bias_correction": bias_correction}
    algo = create(rule, hp)
    x0 = torch.full((2, 3), 0.5)
    state = algo.init({KEY: x0}, ServerContext())
    x, m, v = x0.double().numpy(), np.zeros((2, 3)), np.full((2, 3), 1e-6)
    for t, rs in enumerate(_results(), start=1):
        state, _ = algo.aggregate(t, rs, state)
        d = _avg(rs) - x
        m = hp["beta1"] * m + (1 - hp["beta1"]) * d
        if rule == "fedadagrad":
            v = v + d * d
        elif rule == "fedadam":
            v = 0.99 * v + 0.01 * d * d
        else:
            v = v - 0.01 * d * d * np.sign(v - d * d)
        lr = hp["server_lr"]
        if bias_correction and rule != "fedadagrad":
            lr *= np.sqrt(1 - 0.99 ** t) / (1 - hp["beta1"] ** t)
        x = x + lr * m / (np.sqrt(v) + 1e-3)
        np.testing.assert_allclose(state.globals[KEY].numpy(), x, rtol=1e-5, atol=1e-6)


def test_fedavgm_three_rounds_by_hand():
    algo = create("fedavgm", {"server_lr": 0.7, "server_momentum": 0.5})
    state = algo.init({KEY: torch.zeros(2, 3)}, ServerContext())
    x, v = np.zeros((2, 3)), np.zeros((2, 3))
    for t, rs in enumerate(_results(seed=2), start=1):
        state, _ = algo.aggregate(t, rs, state)
        v = 0.5 * v + (_avg(rs) - x)
        x = x + 0.7 * v
        np.testing.assert_allclose(state.globals[KEY].numpy(), x, rtol=1e-5, atol=1e-6)


def test_fedprox_gradient_is_mu_times_distance():
    theta = torch.randn(4, 5, requires_grad=True)
    anchor = torch.randn(4, 5)
    proximal_term({"w": theta}, {"w": anchor}, mu=0.3).backward()
    torch.testing.assert_close(theta.grad, 0.3 * (theta.detach() - anchor))
    algo = create("fedprox", {"mu": 0.3})
    ctx = ClientContext(0, 1, 1, {}, {}, Payload(params={"w": anchor}))
    loss = algo.client_loss(ctx, torch.tensor(1.0), {"w": theta.detach()})
    assert float(loss) == pytest.approx(1 + 0.15 * float(((theta.detach() - anchor) ** 2).sum()), rel=1e-6)


# ------------------------------------------------------------------ LoRA stacking


def _lora_results(ranks, d_in=6, d_out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for cid, r in enumerate(ranks):
        params = {"m.q_proj.lora_A.weight": torch.randn(r, d_in, generator=g),
                  "m.q_proj.lora_B.weight": torch.randn(d_out, r, generator=g)}
        out.append(ClientResult(cid, 2 + 3 * cid, Upload(params=params)))
    return out


def _dense_update(results, alpha):
    n = np.array([r.num_examples for r in results], float)
    p = n / n.sum()
    return sum(pk * (alpha / r.upload.params["m.q_proj.lora_A.weight"].shape[0])
               * (r.upload.params["m.q_proj.lora_B.weight"].double().numpy()
                  @ r.upload.params["m.q_proj.lora_A.weight"].double().numpy()) for pk, r in zip(p, results))


def test_flora_merges_the_exact_stacked_update_every_round():
    ranks, alpha = [2, 4, 8], 16.0
    algo = create("flora")
    infos = [ClientInfo(i, 1, rank=r, lora_scale=alpha / r) for i, r in enumerate(ranks)]
    state = algo.init({}, ServerContext(infos))
    total = 0
    for rnd, seed in ((1, 0), (2, 1)):
        results = _lora_results(ranks, seed=seed)
        state, _ = algo.aggregate(rnd, results, state)
        total = total + _dense_update(results, alpha)
        np.testing.assert_allclose(state.buffers["base"]["m.q_proj"].double().numpy(), total, rtol=1e-5, atol=1e-5)
        payload = algo.dispatch(rnd + 1, [0, 2], state)[0]
        assert payload.base_version == rnd
        assert payload.bytes_down == (5 * 14 + 14 * 6) * 4  # stacked factors of rank 2+4+8


@pytest.mark.parametrize("ranks", [[2, 4, 8], [3, 3]])
def test_flexlora_factors_are_the_truncated_svd_of_the_averaged_update(ranks):
    alpha = 8.0
    algo = create("flexlora")
    infos = [ClientInfo(i, 1, rank=r, lora_scale=alpha / r) for i, r in enumerate(ranks)]
    state = algo.init({}, ServerContext(infos))
    assert algo.dispatch(1, [0], state)[0].params is None  # round 1: clients start from their own adapters
    results = _lora_results(ranks, seed=4)
    state, _ = algo.aggregate(1, results, state)
    u, s, vh = np.linalg.svd(_dense_update(results, alpha), full_matrices=False)
    for cid, r in enumerate(ranks):
        factors = algo.dispatch(2, [cid], state)[cid].params
        b, a = factors["m.q_proj.lora_B.weight"].double().numpy(), factors["m.q_proj.lora_A.weight"].double().numpy()
        assert b.shape == (5, r) and a.shape == (r, 6)
        np.testing.assert_allclose((alpha / r) * b @ a, (u[:, :r] * s[:r]) @ vh[:r], rtol=1e-5, atol=1e-5)


def test_methods_that_average_factors_refuse_mixed_ranks():
    raw = {"name": "x", "lora": {"rank_choices": [4, 8, 16]}, "clients": {"num_clients": 6}}
    with pytest.raises(ConfigError, match=r"'fedavg' averages LoRA factors.*flora and flexlora"):
        validate({**raw, "algorithm": "fedavg"})
    assert len(set(validate({**raw, "algorithm": "flora"}).client_ranks())) > 1
    validate({**raw, "algorithm": "flexlora"})
    with pytest.raises(ConfigError, match="lora.ranks has 2 entries for 6 clients"):
        validate({**raw, "lora": {"ranks": [4, 8]}, "algorithm": "flora"})


# ------------------------------------------------------------------ SCAFFOLD vs FedAvg


def _quadratic_clients(k=4, dim=5, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        h = rng.normal(size=(dim, dim))
        out.append((torch.tensor(h @ h.T / dim + np.eye(dim) * 0.5), torch.tensor(rng.normal(size=dim) * 5)))
    return out


def _simulate(name, clients, rounds, steps=20, lr=0.05):
    """Local SGD on f_k(w) = ½ wᵀH_k w − b_kᵀw through the plugin's hooks."""
    algo = create(name)
    w0 = {"w": torch.zeros(clients[0][1].shape[0], dtype=torch.float64)}
    infos = [ClientInfo(i, 1) for i in range(len(clients))]
    state = algo.init(w0, ServerContext(infos))
    states = [dict() for _ in clients]
    for rnd in range(1, rounds + 1):
        payloads = algo.dispatch(rnd, list(range(len(clients))), state)
        results = []
        for k, (h, b) in enumerate(clients):
            ctx = ClientContext(k, rnd, 1, w0, states[k], payloads[k], steps=steps, learning_rate=lr)
            w = {"w": algo.client_prepare(ctx, payloads[k])["w"].clone().requires_grad_(True)}
            for _ in range(steps):
                loss = 0.5 * w["w"] @ h @ w["w"] - b @ w["w"]
                loss = algo.client_loss(ctx, loss, w)
                (grad,) = torch.autograd.grad(loss, w["w"])
                w = {"w": (w["w"] - lr * grad).detach().requires_grad_(True)}
            results.append(ClientResult(k, 1, algo.client_upload(ctx, {"w": w["w"].detach()})))
        state, _ = algo.aggregate(rnd, results, state)
    return state.globals["w"]


def test_scaffold_converges_where_fedavg_stalls_under_client_drift():
    clients = _quadratic_clients()
    optimum = torch.linalg.solve(sum(h for h, _ in clients), sum(b for _, b in clients))
    fedavg = _simulate("fedavg", clients, rounds=60)
    scaffold = _simulate("scaffold", clients, rounds=60)
    assert float((scaffold - optimum).norm()) < 1e-3 * float(optimum.norm())
    assert float((fedavg - optimum).norm()) > 0.05 * float(optimum.norm())  # drift: a biased fixed point


# ------------------------------------------------------------------ FedCDA


def test_fedcda_picks_the_older_model_that_agrees_with_the_others():
    algo = create("fedcda", {"history": 2})
    near, far = {KEY: torch.zeros(2, 3)}, {KEY: torch.full((2, 3), 10.0)}
    other = {KEY: torch.full((2, 3), 0.1)}
    state = algo.init(near, ServerContext())
    state, _ = algo.aggregate(1, [ClientResult(0, 1, Upload(params=near)), ClientResult(1, 1, Upload(params=other))], state)
    state, report = algo.aggregate(2, [ClientResult(0, 1, Upload(params=far)), ClientResult(1, 1, Upload(params=other))], state)
    torch.testing.assert_close(state.globals[KEY], torch.full((2, 3), 0.05))  # mean of near and other
    assert report.metrics["fedcda_older_models_chosen"] >= 1


def test_fedcda_selection_is_a_coordinate_optimum():
    g = torch.Generator().manual_seed(1)
    cands = [torch.randn(3, 4, generator=g) for _ in range(4)]
    choice = select(cands, sweeps=5)
    for k in range(4):  # no single client can lower the total pairwise divergence alone
        def total(ch):
            return sum(float(((cands[i][ch[i]] - cands[j][ch[j]]) ** 2).sum()) for i, j in itertools.combinations(range(4), 2))
        best = min(total(choice[:k] + [c] + choice[k + 1:]) for c in range(3))
        assert total(choice) == pytest.approx(best)
    assert flat({"b": torch.ones(2), "a": torch.zeros(1)}).tolist() == [0.0, 1.0, 1.0]


def test_scaffold_defaults_to_no_gradient_clipping_unless_asked():
    from fedsweep.config import load_config, validate

    raw = {"name": "s", "algorithm": "scaffold", "data": {"tasks": ["gcd"]}}
    assert validate(raw).train.grad_clip is None
    assert validate({**raw, "train": {"grad_clip": 0.5}}).train.grad_clip == 0.5  # explicit wins
    assert validate({**raw, "algorithm": "fedavg"}).train.grad_clip == 1.0  # other methods keep 1.0
    from pathlib import Path

    shipped = load_config(Path(__file__).resolve().parents[1] / "configs" / "experiments" / "scaffold.yaml")
    assert shipped.train.grad_clip is None


def _flower_rounds(rule: str, rs_rounds, current: list[np.ndarray]) -> list[np.ndarray]:
    """Flower's FedAdagrad / FedAdam / FedYogi ``aggregate_fit`` update rules, written out by hand
    (flwr defaults: eta=0.1, beta_1=0.9 (adagrad 0.0), beta_2=0.99, tau=1e-9; m_t and v_t start at
    zero; FedAdam's eta_norm uses the exponent server_round + 1; server_round counts from 1)."""
    eta, b1, b2, tau = 0.1, 0.0 if rule == "fedadagrad" else 0.9, 0.99, 1e-9
    m_t, v_t, out = None, None, []
    for server_round, rs in enumerate(rs_rounds, start=1):
        delta_t = [_avg(rs) - current[0]]
        m_t = m_t or [np.zeros_like(x) for x in delta_t]
        m_t = [np.multiply(b1, x) + (1 - b1) * y for x, y in zip(m_t, delta_t)]
        v_t = v_t or [np.zeros_like(x) for x in delta_t]
        if rule == "fedadagrad":
            v_t = [x + np.multiply(y, y) for x, y in zip(v_t, delta_t)]
            eta_now = eta
        elif rule == "fedadam":
            v_t = [b2 * x + (1 - b2) * np.multiply(y, y) for x, y in zip(v_t, delta_t)]
            eta_now = eta * np.sqrt(1 - np.power(b2, server_round + 1.0)) / (1 - np.power(b1, server_round + 1.0))
        else:
            v_t = [x - (1.0 - b2) * np.multiply(y, y) * np.sign(x - np.multiply(y, y)) for x, y in zip(v_t, delta_t)]
            eta_now = eta
        current = [x + eta_now * y / (np.sqrt(z) + tau) for x, y, z in zip(current, m_t, v_t)]
        out.append(current[0])
    return out


@pytest.mark.parametrize("rule", ["fedadagrad", "fedadam", "fedyogi"])
def test_flower_compatible_setting_gives_flowers_numbers(rule):
    hp = {"server_lr": 0.1, "tau": 1e-9, "v0": "zero", "beta1": 0.0 if rule == "fedadagrad" else 0.9,
          "beta2": 0.99, "bias_correction": "flower" if rule == "fedadam" else False}
    algo = create(rule, hp)
    x0 = torch.full((2, 3), 0.5, dtype=torch.float64)
    rs_rounds = [[ClientResult(r.cid, r.num_examples, Upload(params={KEY: r.upload.params[KEY].double()})) for r in rs]
                 for rs in _results(rounds=4, seed=3)]
    expected = _flower_rounds(rule, rs_rounds, [x0.numpy()])
    state = algo.init({KEY: x0}, ServerContext())
    for t, (rs, want) in enumerate(zip(rs_rounds, expected), start=1):
        state, _ = algo.aggregate(t, rs, state)
        np.testing.assert_allclose(state.globals[KEY].numpy(), want, rtol=1e-12, atol=1e-12)
    # and the defaults (Reddi et al.: v0 = τ², τ = 1e-3, η = 1e-2) do not
    default = create(rule)
    st = default.init({KEY: x0}, ServerContext())
    st, _ = default.aggregate(1, rs_rounds[0], st)
    assert not np.allclose(st.globals[KEY].numpy(), expected[0])
