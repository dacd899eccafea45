"""FedReFT+ against independent computations: scipy's minimiser, hand-built interventions."""

from __future__ import annotations

import numpy as np
import pytest

from fedsweep.algorithms.types import ServerContext
import torch
from scipy.optimize import minimize

from fedsweep.config import validate
from fedsweep.algorithms import create
from fedsweep.algorithms.types import ClientContext, ClientResult, Payload, Upload
from fedsweep.algorithms.fedreft import geometric_median_abm, mean_abm, mix, orthonormalize_rows
from fedsweep.models.reft import LoReFT, count_parameters, prompt_masks

from in_process import client_actor


def scipy_median(points: np.ndarray) -> np.ndarray:
    res = minimize(lambda y: np.linalg.norm(points - y, axis=1).sum(), points.mean(0), method="Nelder-Mead",
                   options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 40_000, "maxfev": 40_000})
    return res.x


@pytest.mark.parametrize("seed", range(8))
def test_abm_median_matches_scipy_and_leaves_each_client_out(seed):
    rng = np.random.default_rng(seed)
    pts = rng.normal(size=(6, 3)) * [1, 3, 0.5]
    # near a data point Weiszfeld converges slowly: give it the iterations (these sets are tiny)
    got, _ = geometric_median_abm(torch.tensor(pts), tol=1e-14, max_iter=50_000)
    for k in range(6):
        rest = np.delete(pts, k, axis=0)
        expected = scipy_median(rest)
        np.testing.assert_allclose(got[k].numpy(), expected, atol=1e-5)
        f = lambda y: np.linalg.norm(rest - y, axis=1).sum()  # noqa: E731
        assert f(got[k].numpy()) <= f(expected) + 1e-9


def test_median_on_a_data_point():
    # a centre point with four symmetric neighbours: the median is the centre itself
    pts = np.array([[0.0, 0.0], [1, 0], [-1, 0], [0, 1], [0, -1], [50, 50]])
    got, _ = geometric_median_abm(torch.tensor(pts), tol=1e-12, max_iter=5000)
    # client 5 (the far point) is left out of its own ABM: the median of the rest is the centre
    np.testing.assert_allclose(got[5].numpy(), [0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(got[5].numpy(), scipy_median(pts[:5]), atol=1e-5)


def test_abm_for_client_k_never_uses_client_k():
    rng = np.random.default_rng(7)
    pts = torch.tensor(rng.normal(size=(5, 4)))
    base, _ = geometric_median_abm(pts, tol=1e-12, max_iter=2000)
    moved = pts.clone()
    moved[2] += 100.0
    after, _ = geometric_median_abm(moved, tol=1e-12, max_iter=2000)
    torch.testing.assert_close(after[2], base[2])
    assert all(not torch.allclose(after[k], base[k]) for k in (0, 1, 3, 4))
    expected_mean = (pts.sum(0) - pts[2]) / 4
    torch.testing.assert_close(mean_abm(pts)[2], expected_mean)


def _local_abm(seed=0, r=3, d=8):
    g = torch.Generator().manual_seed(seed)
    local = {"reft.layers.0.all.W": torch.randn(r, d, generator=g),
             "reft.layers.0.all.R": orthonormalize_rows(torch.randn(r, d, generator=g)),
             "reft.layers.0.all.b": torch.randn(r, generator=g)}
    abm = {k: torch.randn(v.shape, generator=g) for k, v in local.items()}
    return local, abm


def test_mixing_endpoints_and_orthonormal_r():
    local, abm = _local_abm()
    keep = mix(local, abm, 0.0)
    assert all(torch.allclose(keep[k], local[k], atol=1e-6) for k in local)
    take = mix(local, abm, 1.0)
    for k in ("reft.layers.0.all.W", "reft.layers.0.all.b"):
        assert torch.equal(take[k], abm[k])
    torch.testing.assert_close(take["reft.layers.0.all.R"], orthonormalize_rows(abm["reft.layers.0.all.R"]))
    for alpha in (0.3, 0.7, 1.0):
        r = mix(local, abm, alpha)["reft.layers.0.all.R"]
        torch.testing.assert_close(r @ r.T, torch.eye(3), atol=1e-5, rtol=0)


def test_intervention_with_w_equal_r_and_zero_b_is_the_identity():
    mod = LoReFT(16, 4)
    with torch.no_grad():
        mod.W.copy_(mod.R)
        mod.b.zero_()
    h = torch.randn(2, 5, 16)
    torch.testing.assert_close(mod(h), h, atol=1e-6, rtol=0)
    # and in general Φ(h) = h + Rᵀ(Wh + b − Rh), by hand
    with torch.no_grad():
        mod.W.normal_()
        mod.b.normal_()
    manual = h + (h @ mod.W.T + mod.b - h @ mod.R.T) @ mod.R
    torch.testing.assert_close(mod(h), manual)
    assert mod(h.bfloat16()).dtype == torch.bfloat16


def test_prompt_positions():
    first, last = prompt_masks(torch.tensor([5, 2]), torch.tensor([0, 3]), width=6, p=2, s=2)
    assert first.int().tolist() == [[1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0]]
    assert last.int().tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]]  # a 2-token prompt is all "first"


# the paper's Table 13 rows with their own settings: LLaMA-2-13B's 6.55 M is the untied r=8 count
@pytest.mark.parametrize("d,layers,r,tied,millions", [(2048, 22, 8, True, 0.72), (4096, 32, 8, True, 2.10),
                                                       (5120, 40, 8, False, 6.55), (1024, 24, 1, True, 0.0492)])
def test_table_13_trainable_counts(d, layers, r, tied, millions):
    n = count_parameters(d, layers, r, tied=tied)
    assert n == (1 if tied else 2) * layers * (2 * r * d + r)
    assert round(n / 1e6, 4 if millions < 0.1 else 2) == millions


def test_plugin_round_shares_only_chosen_types_and_mixes_on_the_client():
    algo = create("fedreft", {"share": ["R", "b"], "alpha": 0.25, "alpha_tuning": "fixed"})
    sets = [_local_abm(seed)[0] for seed in range(3)]
    uploads = [algo.client_upload(ClientContext(i, 1, 1, s, {}, Payload()), s) for i, s in enumerate(sets)]
    assert all(set(u.params) == {"reft.layers.0.all.R", "reft.layers.0.all.b"} for u in uploads)
    state = algo.init({}, ServerContext())
    state, _ = algo.aggregate(1, [ClientResult(i, 1, u) for i, u in enumerate(uploads)], state)
    # two others: every point between them is a median; Weiszfeld from their mean stays at the midpoint
    for k in ("reft.layers.0.all.R", "reft.layers.0.all.b"):
        torch.testing.assert_close(state.personal[0][k], (sets[1][k] + sets[2][k]) / 2, atol=1e-6, rtol=0)
    ctx = ClientContext(0, 2, 1, sets[0], {}, algo.dispatch(2, [0], state)[0])
    start = algo.client_prepare(ctx, ctx.payload)
    assert torch.equal(start["reft.layers.0.all.W"], sets[0]["reft.layers.0.all.W"])  # unshared: untouched
    torch.testing.assert_close(start["reft.layers.0.all.b"],
                               0.75 * sets[0]["reft.layers.0.all.b"] + 0.25 * state.personal[0]["reft.layers.0.all.b"])


def test_loss_grid_picks_the_alpha_of_least_validation_loss():
    algo = create("fedreft", {"alpha_tuning": "loss_grid"})
    local, abm = _local_abm(3)
    target = mix(local, abm, 0.7)["reft.layers.0.all.W"]
    ctx = ClientContext(0, 2, 1, local, {}, Payload(params=abm),
                        eval_loss=lambda p, split: float(((p["reft.layers.0.all.W"] - target) ** 2).sum()))
    algo.client_prepare(ctx, ctx.payload)
    assert float(ctx.state["alpha"]) == pytest.approx(0.7)


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("float32", 1e-5)])
def test_the_alpha_grid_of_a_group_in_one_pass_picks_what_each_client_alone_picks(dtype, tolerance):
    """``client_prepare_group`` (every α of every client in one pass of ``MethodHooks.losses``) against
    ``client_prepare`` of each client alone (eleven validation losses one after another, the independent
    computation): the same α for every client, each candidate's loss within rounding, the same start."""
    from fedsweep.actors.method_hooks import MethodHooks
    from fedsweep.algorithms.types import Candidate
    from fedsweep.data import bundled
    from fedsweep.data.partition import make_clients

    tasks = ["basic_arithmetic", "gcd", "leg_counting"]
    parts = make_clients(bundled.generate(tasks, 20, 0), "task", 3, seed=0, test_fraction=0.25, val_fraction=0.25)
    clients = [dict(cid=c.cid, train=c.train, test=c.test, val=c.val) for c in parts]
    cfg = validate({"name": "r", "algorithm": "fedreft", "adapter": "reft", "model": {"dtype": dtype},
                    "reft": {"rank": 2, "first": 2, "last": 2}, "data": {"tasks": tasks, "val_fraction": 0.25},
                    "partition": {"scheme": "task"}, "clients": {"num_clients": 3}})
    actor = client_actor(cfg, clients)
    gen = torch.Generator().manual_seed(1)
    slots = [actor.slots[c] for c in sorted(actor.slots)]
    for slot in slots:  # trained-looking locals, and an aggregate far from each
        slot.params = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in slot.params.items()}
    abm = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in slots[0].params.items() if k.endswith((".W", ".b"))}
    payloads = [Payload(params=abm), Payload(), Payload(params=abm)]  # client 1: nothing aggregated yet
    algo = actor.algo
    alone = [actor.hooks.context(2, s, p) for s, p in zip(slots, payloads)]
    starts_alone = [algo.client_prepare(c, p) for c, p in zip(alone, payloads)]
    together = [actor.hooks.context(2, s, p) for s, p in zip(slots, payloads)]
    work: dict = {}
    starts = algo.client_prepare_group(together, payloads, actor.hooks.tools(slots, work))
    assert [float(c.state.get("alpha", -1)) for c in together] == [float(c.state.get("alpha", -1)) for c in alone]
    assert work["scored_candidates"] == 22  # two clients tuned, eleven mixes each, in one pass
    for a, b in zip(starts_alone, starts):
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)  # the chosen mix, bit for bit
    mixes = [mix(slots[0].params, abm, g) for g in (0.0, 0.5, 1.0)]
    grouped = MethodHooks.losses(actor.hooks, slots, [Candidate(0, m, "val") for m in mixes], {})
    for m, got in zip(mixes, grouped):
        assert got == pytest.approx(actor.hooks.split_loss(slots[0], m, "val"), rel=tolerance)


def test_reft_actor_saves_restores_and_uploads_exact_sizes(tmp_path):
    from fedsweep.data import bundled
    from fedsweep.data.partition import make_clients

    tasks = ["basic_arithmetic", "gcd"]
    parts = make_clients(bundled.generate(tasks, 16, 0), "task", 2, seed=0, test_fraction=0.25, val_fraction=0.25)
    clients = [dict(cid=c.cid, train=c.train, test=c.test, val=c.val) for c in parts]
    cfg = {"name": "r", "algorithm": "fedreft", "adapter": "reft", "reft": {"rank": 2, "first": 2, "last": 2, "tied": True},
           "data": {"tasks": tasks, "val_fraction": 0.25}, "partition": {"scheme": "task"}, "clients": {"num_clients": 2},
           "train": {"steps": 3, "learning_rate": 0.01}}
    a = client_actor(validate(cfg), clients)
    result = a.train(1, 0, Payload())
    assert result.bytes_up == 2 * (2 * 2 * 64 + 2) * 4  # 2 layers of the tiny model, d = 64, r = 2, fp32
    r = a.client_params(0)["reft.layers.1.all.R"]
    torch.testing.assert_close(r @ r.T, torch.eye(2), atol=1e-5, rtol=0)  # retraction keeps R orthonormal
    a.save(str(tmp_path))
    (tmp_path / "COMPLETE").write_text('{"round": 1}')
    b = client_actor(validate(cfg), clients)
    b.restore(str(tmp_path))
    ra, rb = a.train(2, 0, Payload()), b.train(2, 0, Payload())
    assert all(torch.equal(ra.upload.params[k], rb.upload.params[k]) for k in ra.upload.params)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_reft_trains_on_a_base_of_either_dtype(dtype):
    from fedsweep.data import bundled
    from fedsweep.data.partition import make_clients

    tasks = ["basic_arithmetic", "gcd"]
    parts = make_clients(bundled.generate(tasks, 12, 0), "task", 2, seed=0, test_fraction=0.25)
    clients = [dict(cid=c.cid, train=c.train, test=c.test) for c in parts[:1]]
    cfg = {"name": "r", "algorithm": "fedreft", "adapter": "reft", "model": {"dtype": dtype},
           "reft": {"rank": 2, "first": 2, "last": 2}, "fedreft": {"alpha_tuning": "fixed"},
           "data": {"tasks": tasks}, "partition": {"scheme": "task"},
           "clients": {"num_clients": 2}, "train": {"steps": 4, "learning_rate": 0.01}}
    actor = client_actor(validate(cfg), clients)
    assert next(actor.model.parameters()).dtype == getattr(torch, dtype)
    before = actor.hooks.split_loss(actor.slots[0], actor.slots[0].params, "train")
    actor.train(1, 0, Payload())
    after = actor.hooks.split_loss(actor.slots[0], actor.slots[0].params, "train")
    assert np.isfinite(after) and after < before
    assert all(v.dtype == torch.float32 for v in actor.client_params(0).values())  # interventions stay fp32


# ---------------------------------------------------------------- geometric-median accuracy (defaults)


def _objective(points: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(points - y, axis=1).sum())


def _scipy_min(points: np.ndarray) -> np.ndarray:
    """L-BFGS on Σ‖y − x_m‖ (analytic gradient), from the mean, then Nelder-Mead polish in low dims."""
    def f(y):
        diff = y - points
        n = np.sqrt((diff ** 2).sum(1) + 1e-300)
        return n.sum(), (diff / n[:, None]).sum(0)
    res = minimize(f, points.mean(0), jac=True, method="L-BFGS-B", options={"maxiter": 20_000, "ftol": 1e-15, "gtol": 1e-12})
    y = res.x
    if points.shape[1] <= 4:
        y = scipy_median(points) if _objective(points, scipy_median(points)) < _objective(points, y) else y
    return y


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_default_settings_reach_the_minimum_within_1e_6(seed, dtype):
    rng = np.random.default_rng(100 + seed)
    pts = rng.normal(size=(7, 3)) * [1, 4, 0.2]
    got, _ = geometric_median_abm(torch.tensor(pts, dtype=dtype))
    for k in range(7):
        rest = np.delete(pts, k, axis=0)
        best = _objective(rest, _scipy_min(rest))
        assert _objective(rest, got[k].double().numpy()) <= best * (1 + 1e-6)


def test_duplicated_uploads_count_with_their_multiplicity():
    a = np.array([0.0, 0.0, 0.0])
    b, c, e = np.array([3.0, 1.0, 0.0]), np.array([0.0, 2.5, -1.0]), np.array([-4.0, -4.0, 2.0])
    pts = torch.tensor(np.stack([a, a, b, c, e]))
    got, _ = geometric_median_abm(pts)
    assert torch.equal(got[4], pts[0])  # the others are {a, a, b, c}: a, with weight 2, is the median
    rest = np.stack([a, a, b, c])
    assert _objective(rest, got[4].numpy()) <= _objective(rest, _scipy_min(rest)) * (1 + 1e-12)


def test_large_common_offset_changes_nothing():
    rng = np.random.default_rng(3)
    spread = rng.normal(size=(6, 5))
    offset = np.full(5, 1e5 / np.sqrt(5))  # spread/‖c‖ ≈ 1e-5
    plain, _ = geometric_median_abm(torch.tensor(spread))
    shifted, _ = geometric_median_abm(torch.tensor(spread + offset))
    np.testing.assert_allclose(shifted.numpy() - offset, plain.numpy(), atol=1e-6 * 1e5 * 1e-5 * 10)
    for k in range(6):
        rest = np.delete(spread, k, axis=0)
        best = _objective(rest, _scipy_min(rest))
        assert _objective(rest, shifted[k].numpy() - offset) <= best * (1 + 1e-6)


def test_high_dimensional_medians_reach_the_minimum():
    rng = np.random.default_rng(5)
    pts = rng.normal(size=(5, 200_000)) * 0.01 + rng.normal(size=200_000) * 0.001
    got, _ = geometric_median_abm(torch.tensor(pts))
    for k in (0, 3):
        rest = np.delete(pts, k, axis=0)
        best = _objective(rest, _scipy_min(rest))
        assert _objective(rest, got[k].numpy()) <= best * (1 + 1e-6)


def test_loss_grid_without_a_validation_split_is_refused_in_one_line():
    from fedsweep.config import ConfigError, validate

    raw = {"name": "r", "algorithm": "fedreft", "adapter": "reft", "data": {"tasks": ["gcd"]}}
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert "data.val_fraction" in str(err.value) and "\n" not in str(err.value)
    assert validate({**raw, "data": {"tasks": ["gcd"], "val_fraction": 0.2}}).algo_params.alpha_tuning == "loss_grid"
    assert validate({**raw, "fedreft": {"alpha_tuning": "fixed"}}).reft.tied is False  # the paper's default


def test_shipped_fedreft_configs_use_the_papers_setting():
    import yaml
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    for name in ("fedreft_distinct.yaml", "fedreft_mixed.yaml"):
        raw = yaml.safe_load((root / "experiments" / name).read_text())
        assert raw["reft"]["tied"] is False and raw["fedreft"]["alpha_tuning"] == "loss_grid"
        assert raw["data"]["val_fraction"] > 0
    main = yaml.safe_load((root / "sweeps" / "main.yaml").read_text())["variants"]["fedreft"]
    assert main["reft.tied"] is False and main["fedreft.alpha_tuning"] == "loss_grid" and main["data.val_fraction"] > 0


def test_intervention_dropout_acts_on_the_output_at_intervened_positions_only():
    from fedsweep.models.reft import ReftHooks

    class Block(torch.nn.Module):
        def forward(self, h):
            return h

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([Block()])
            self.config = type("C", (), {"hidden_size": 8})()
            self.anchor = torch.nn.Parameter(torch.zeros(1))

        def forward(self, h):
            return self.model.layers[0](h)

    from fedsweep.models.stacked_reft import StackedReft

    toy = Toy()
    hooks = ReftHooks(toy, rank=2, layers=None, tied=True, seed=0, dropout=0.5)
    mod = hooks.modules["layers_0_all"]
    hooks.stack = StackedReft({k: v.detach() for k, v in hooks.parameters().items()}, 1, "cpu")
    hooks.stack.write_all([{k: v.detach() for k, v in hooks.parameters().items()}])
    h = torch.randn(3, 6, 8)
    first = torch.zeros(3, 6, dtype=torch.bool)
    first[:, :2] = True
    last = torch.zeros(3, 6, dtype=torch.bool)
    phi = mod(h).detach()
    with hooks.positions(first, last), hooks.stack.rows([0, 0, 0]):
        toy.eval()
        torch.testing.assert_close(toy(h)[first], phi[first])  # no dropout outside training
        toy.train()
        torch.manual_seed(0)
        out = toy(h).detach()
    assert torch.equal(out[~first], h[~first])  # positions not intervened on are untouched
    kept = out[first] != 0
    torch.testing.assert_close(out[first][kept], 2.0 * phi[first][kept])  # inverted dropout: scaled by 1/(1−p)
    assert 0.3 < float(kept.float().mean()) < 0.7


@pytest.mark.parametrize("owners", [[1, 1, 1, 1], [0, 0, 2, 2], [2, 0, 0, 1]])  # one client, equal runs, any
def test_stacked_interventions_give_every_row_its_own_clients_intervention_and_head(owners):
    """``StackedReft`` against each client's own ``LoReFT`` module and ``ClassificationHead`` (the
    independent computation, eq. 1 and 3), row by row, for the three ways a forward's rows are laid out;
    its QR retraction against ``orthonormalize_rows`` of each client."""
    from fedsweep.algorithms.fedreft import orthonormalize_rows
    from fedsweep.models.reft import ClassificationHead, LoReFT
    from fedsweep.models.stacked_reft import StackedReft

    torch.manual_seed(0)
    d, r, k = 6, 2, 3
    mods = [LoReFT(d, r).double() for _ in range(k)]
    heads = [ClassificationHead(d, 3).double() for _ in range(k)]
    for m in mods:  # non-orthonormal R (as after an optimiser step) and a non-zero b
        m.R.data += 0.1 * torch.randn(r, d, dtype=torch.float64)
        m.b.data = torch.randn(r, dtype=torch.float64)
    sets = [{**{f"reft.layers.0.all.{n}": getattr(m, n).detach() for n in ("W", "R", "b")},
             **{f"reft.head.{n}": getattr(h, n).detach() for n in ("W_d", "b_d", "W_o", "b_o")}}
            for m, h in zip(mods, heads)]
    stack = StackedReft(sets[0], k, "cpu")
    stack.write_all(sets)
    h = torch.randn(len(owners), 5, d, dtype=torch.float64)
    with stack.rows(owners):
        delta = stack.delta("reft.layers.0.all", h)
        logits = stack.head(h[:, -1])
    for i, o in enumerate(owners):
        torch.testing.assert_close(delta[i], mods[o].delta(h[i]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(logits[i], heads[o](h[i, -1]), rtol=1e-12, atol=1e-12)
    stack.retract([0, 2])  # client 1 sat the step out: its R untouched
    got = stack.read_all()
    for c in range(k):
        want = orthonormalize_rows(sets[c]["reft.layers.0.all.R"]) if c != 1 else sets[c]["reft.layers.0.all.R"]
        torch.testing.assert_close(got[c]["reft.layers.0.all.R"], want, rtol=0, atol=1e-13)
    with pytest.raises(RuntimeError, match="outside StackedReft.rows"):
        stack.delta("reft.layers.0.all", h)
