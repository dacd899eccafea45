"""FedICU against independent computations (numpy loops, scipy's expit, hand-worked masks)."""

from __future__ import annotations

import numpy as np
import pytest

from fedsweep.algorithms.types import ServerContext
import torch
from scipy.special import expit, softmax

from fedsweep.config import validate
from fedsweep.algorithms import create
from fedsweep.algorithms.types import ClientContext, ClientResult, Payload, Upload
from fedsweep.algorithms.fedicu import divergence_weights, importance_mask, split

from in_process import client_actor

A, B = "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight"


def _sets(k, r=3, d_in=7, d_out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{A: torch.randn(r, d_in, generator=g), B: torch.randn(d_out, r, generator=g)} for _ in range(k)]


@pytest.mark.parametrize("key,axis", [(A, 0), (B, 1)])
def test_split_reconstructs_the_factor_exactly(key, axis):
    t = _sets(1)[0][key]
    m, v = split(t, axis)
    rebuilt = (m.unsqueeze(-1) * v) if axis == 0 else (m.unsqueeze(-1) * v).T
    torch.testing.assert_close(rebuilt, t.double(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v.norm(dim=-1), torch.ones(3, dtype=torch.float64))


def _expected_global(uploads, tau):
    """Independent per-slice loop: θ_r = mean_k‖θ_kr‖ · Σ_k w_kr θ_kr/‖θ_kr‖ (eq. 6 and 12 telescoped)."""
    out = {}
    for key, axis in ((A, 0), (B, 1)):
        mats = [u[key].double().numpy() for u in uploads]
        mats = [m if axis == 0 else m.T for m in mats]  # rows = rank components
        k, r = len(mats), mats[0].shape[0]
        rows = []
        for j in range(r):
            vecs = [m[j] for m in mats]
            norms = [np.linalg.norm(v) for v in vecs]
            units = [v / n for v, n in zip(vecs, norms)]
            s = [np.mean([units[p] @ units[q] for q in range(k) if q != p]) for p in range(k)]
            w = softmax(np.array(s) / tau)
            rows.append(np.mean(norms) * sum(w[p] * units[p] for p in range(k)))
        res = np.stack(rows)
        out[key] = res if axis == 0 else res.T
    return out


@pytest.mark.parametrize("tau", [0.05, 0.1, 1.0])
def test_server_aggregation_matches_a_per_slice_loop(tau):
    uploads = _sets(4, seed=1)
    algo = create("fedicu", {"tau": tau})
    state = algo.init(_sets(1, seed=9)[0], ServerContext())  # an arbitrary previous global: it must cancel out
    results = [ClientResult(i, 10 + i, Upload(params=u)) for i, u in enumerate(uploads)]
    state, _ = algo.aggregate(1, results, state)
    expected = _expected_global(uploads, tau)
    for key in (A, B):
        np.testing.assert_allclose(state.globals[key].numpy(), expected[key], rtol=1e-5, atol=1e-6)


def test_temperature_limits():
    # one slice (r=1), three clients: client 1 sits between 0 and 2, so it is the most similar to the others
    v = torch.tensor([[[1.0, 0.0]], [[2 ** -0.5, 2 ** -0.5]], [[0.0, 1.0]]])
    cold = divergence_weights(v, tau=1e-4)[:, 0]
    hot = divergence_weights(v, tau=1e6)[:, 0]
    torch.testing.assert_close(cold, torch.tensor([0.0, 1.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(hot, torch.full((3,), 1 / 3), atol=1e-5, rtol=0)


def test_mask_rule_on_constructed_tensors():
    g = torch.tensor([0.0, 0.0, 0.0, 10.0])  # I = σ(z(|g|)) = [.36, .36, .36, .85]
    m_prev = torch.ones(4)  # σ(|m_prev|) = 0: G saturates to 0 or 1
    m_new = torch.tensor([2.0, 0.5, -2.0, 2.0])
    assert importance_mask(g, m_new, m_prev, smooth=False).tolist() == [1.0, 0.0, 1.0, 1.0]


def test_mask_matches_scipy_on_random_tensors():
    gen = torch.Generator().manual_seed(3)
    g, m_prev, m_new = (torch.randn(50, generator=gen) for _ in range(3))
    imp = expit((np.abs(g.numpy()) - np.abs(g.numpy()).mean()) / (np.abs(g.numpy()).std() + 1e-6))
    spec = expit((np.abs(m_new.numpy()) - np.abs(m_prev.numpy()).mean()) / (np.abs(m_prev.numpy()).std() + 1e-6))
    np.testing.assert_array_equal(importance_mask(g, m_new, m_prev, smooth=False).numpy(), (spec > imp).astype(np.float32))
    smooth = np.where(spec > imp, np.minimum(1, spec / (imp + spec)), 0)
    np.testing.assert_allclose(importance_mask(g, m_new, m_prev, smooth=True).numpy(), smooth, rtol=1e-5)


def _ctx(glob, state, rnd):
    return ClientContext(cid=0, rnd=rnd, num_examples=1, local_params=glob, state=state, payload=Payload(params=glob))


def test_first_participation_uploads_everything_then_sparse():
    algo = create("fedicu", {"beta": 0.5, "zscore": "tensor"})
    glob, trained = _sets(2, seed=4)
    state: dict = {}
    first = algo.client_upload(_ctx(glob, state, 1), trained)
    dense = sum(t.numel() * 4 for t in trained.values())
    assert all(torch.equal(first.params[k], trained[k]) for k in trained)
    assert first.nbytes == dense and first.metrics["upload_fraction"] == 1.0
    m1 = {k: 0.5 * (trained[k] - glob[k]) for k in trained}
    assert all(torch.allclose(state["m/" + k], m1[k]) for k in trained)

    trained2 = {k: v + 0.3 * torch.randn_like(v) for k, v in trained.items()}
    second = algo.client_upload(_ctx(glob, state, 2), trained2)
    sent = 0
    for k in trained:
        m2 = 0.5 * m1[k] + 0.5 * (trained2[k] - glob[k])
        w = importance_mask(glob[k], m2, m1[k], smooth=False)
        torch.testing.assert_close(second.params[k], glob[k] + w * m2)
        sent += int(w.sum())
    assert second.nbytes == sent * 4 < dense


def test_splitting_off_is_fedavg():
    uploads = _sets(3, seed=5)
    results = [ClientResult(i, n, Upload(params=u)) for i, (u, n) in enumerate(zip(uploads, [1, 2, 7]))]
    a = create("fedicu", {"splitting": False})
    b = create("fedavg")
    ga = a.aggregate(1, results, a.init(uploads[0], ServerContext()))[0].globals
    gb = b.aggregate(1, results, b.init(uploads[0], ServerContext()))[0].globals
    assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_momentum_survives_save_and_restore(tmp_path):
    from fedsweep.data import bundled
    from fedsweep.data.partition import make_clients

    recs = bundled.generate(["basic_arithmetic", "gcd"], 12, 0)
    clients = [dict(cid=c.cid, train=c.train, test=c.test) for c in make_clients(recs, "task", 2, seed=0, test_fraction=0.25)]
    cfg = {"name": "icu", "algorithm": "fedicu", "lora": {"r": 2}, "train": {"steps": 2},
           "partition": {"scheme": "task"}, "clients": {"num_clients": 2}, "data": {"tasks": ["basic_arithmetic", "gcd"]}}
    a = client_actor(validate(cfg), clients)
    start = a.initial_params()
    a.train(1, 0, Payload(params=start))
    a.save(str(tmp_path))
    (tmp_path / "COMPLETE").write_text('{"round": 1}')
    b = client_actor(validate(cfg), clients)
    b.restore(str(tmp_path))
    assert b.slots[0].algo_state.keys() == a.slots[0].algo_state.keys() and b.slots[0].algo_state
    for k, v in a.slots[0].algo_state.items():
        assert torch.equal(v, b.slots[0].algo_state[k])
    ua, ub = a.train(2, 0, Payload(params=start)), b.train(2, 0, Payload(params=start))
    assert ua.bytes_up == ub.bytes_up < sum(t.numel() * 4 for t in start.values())
    assert all(torch.equal(ua.upload.params[k], ub.upload.params[k]) for k in start)


def _sigmoid_z(x, ref):
    return expit((x - ref.mean()) / (ref.std() + 1e-6))


def test_model_zscore_uses_statistics_of_the_whole_parameter_vector():
    """Appendix I: μ and σ over θ ∈ ℝ^d (all tensors together), against numpy on the concatenation."""
    algo = create("fedicu", {"beta": 0.5})
    assert algo.hp.zscore == "model"
    gen = torch.Generator().manual_seed(11)
    glob = {A: torch.randn(3, 7, generator=gen) * 0.01, B: torch.randn(5, 3, generator=gen)}  # different scales
    state: dict = {}
    algo.client_upload(_ctx(glob, state, 1), {k: v + torch.randn(v.shape, generator=gen) for k, v in glob.items()})
    m1 = {k: state["m/" + k].clone() for k in glob}
    trained = {k: v + torch.randn(v.shape, generator=gen) for k, v in glob.items()}
    up = algo.client_upload(_ctx(glob, state, 2), trained)
    g_all = np.concatenate([np.abs(glob[k].double().numpy()).ravel() for k in (A, B)])
    m_all = np.concatenate([np.abs(m1[k].double().numpy()).ravel() for k in (A, B)])
    flips = 0
    for k in (A, B):
        m2 = 0.5 * m1[k].double().numpy() + 0.5 * (trained[k].double().numpy() - glob[k].double().numpy())
        imp = _sigmoid_z(np.abs(glob[k].double().numpy()), g_all)
        spec = _sigmoid_z(np.abs(m2), m_all)
        w = (spec > imp).astype(np.float64)
        np.testing.assert_allclose(up.params[k].double().numpy(), glob[k].double().numpy() + w * m2, rtol=1e-5, atol=1e-6)
        per_tensor = (_sigmoid_z(np.abs(m2), np.abs(m1[k].double().numpy()))
                      > _sigmoid_z(np.abs(glob[k].double().numpy()), np.abs(glob[k].double().numpy())))
        flips += int((per_tensor != (w > 0)).sum())
    assert flips > 0  # the two readings really differ on this example


def test_zero_norm_components_have_no_direction_and_tiny_ones_are_unit():
    """Two of three clients have a B column of norm ~1e-8, one client a column exactly 0: tiny
    columns are unit directions like any other; the zero column is left out of eq. 9–12."""
    ups = _sets(3, seed=6)
    ups[0][B][:, 1] *= 1e-8 / float(ups[0][B][:, 1].norm())
    ups[1][B][:, 1] *= 1e-8 / float(ups[1][B][:, 1].norm())
    ups[2][B][:, 2] = 0.0
    algo = create("fedicu", {"tau": 0.1})
    state = algo.init(_sets(1, seed=9)[0], ServerContext())
    state, _ = algo.aggregate(1, [ClientResult(i, 1, Upload(params=u)) for i, u in enumerate(ups)], state)
    # independent reference: per column, numpy float64, zero columns left out of the direction
    tau = 0.1
    mats = [u[B].double().numpy() for u in ups]
    for j in range(3):
        cols = [m[:, j] for m in mats]
        norms = np.array([np.linalg.norm(c) for c in cols])
        idx = [p for p in range(3) if norms[p] > 0]
        units = {p: cols[p] / norms[p] for p in idx}
        s = np.array([np.mean([units[p] @ units[q] for q in idx if q != p]) for p in idx])
        w = softmax(s / tau)
        expected = norms.mean() * sum(wi * units[p] for wi, p in zip(w, idx))
        np.testing.assert_allclose(state.globals[B][:, j].double().numpy(), expected, rtol=1e-5, atol=1e-9)
    assert torch.isfinite(state.globals[B]).all()


def test_a_slice_without_any_direction_stays_zero_and_finite():
    ups = _sets(2, seed=3)
    for u in ups:
        u[A][0] = 0.0
    prev = _sets(1, seed=9)[0]
    algo = create("fedicu")
    state, _ = algo.aggregate(1, [ClientResult(i, 1, Upload(params=u)) for i, u in enumerate(ups)],
                              algo.init(prev, ServerContext()))
    # magnitude mean(0, 0) = 0: the row is 0, and finite
    assert torch.equal(state.globals[A][0], torch.zeros(7))
    v = divergence_weights(torch.zeros(2, 1, 4, dtype=torch.float64), 0.1, torch.zeros(2, 1, dtype=torch.bool))
    assert torch.equal(v, torch.zeros(2, 1, dtype=torch.float64))


@pytest.mark.parametrize("zscore, smooth", [("model", False), ("tensor", False), ("model", True)])
def test_a_groups_uploads_at_once_are_each_clients_own_bit_for_bit(zscore, smooth):
    """``client_upload_group`` (eq. 14-18 over the group's (K, P) array) against ``client_upload`` of each
    client (eq. 14-18 tensor by tensor, the independent computation): the same uploaded tensors, bytes and
    momentum bit for bit, for clients on their first participation (uploading everything) beside clients
    uploading sparsely, under either statistic and either mask."""
    algo = create("fedicu", {"zscore": zscore, "smooth_mask": smooth})
    gen = torch.Generator().manual_seed(7)
    shapes = {"m.q.lora_A.weight": (4, 24), "m.q.lora_B.weight": (32, 4), "m.v.lora_A.weight": (4, 24),
              "m.v.lora_B.weight": (16, 4)}
    glob = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    payload = Payload(params=glob)

    def contexts():
        out = []
        for c in range(4):
            g2 = torch.Generator().manual_seed(100 + c)
            state = {} if c == 1 else {"m/" + k: 0.1 * torch.randn(s, generator=g2) for k, s in shapes.items()}
            out.append(ClientContext(c, 3, 10, {}, state, payload))
        return out

    trained = [{k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in glob.items()} for _ in range(4)]
    alone = contexts()
    want = [algo.client_upload(ctx, p) for ctx, p in zip(alone, trained)]
    together = contexts()
    got = algo.client_upload_group(together, trained, None)
    for a, b, ca, cb in zip(want, got, alone, together):
        assert a.nbytes == b.nbytes and a.sent_share == b.sent_share and a.metrics == b.metrics
        for k in shapes:
            assert torch.equal(a.params[k], b.params[k]), k
            assert torch.equal(ca.state["m/" + k], cb.state["m/" + k]), k
    assert want[1].sent_share == 1.0 and 0 < want[0].sent_share < 1  # first participation: everything
