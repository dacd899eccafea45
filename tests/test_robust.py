"""Robust aggregation rules, attacks and compressed uploads against independent computations
(numpy and hand-computed values), in the hard cases: ties, even counts, f at its bound, blocks of
zeros, equal magnitudes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep.federation import attacks, robust
from fedsweep.federation.codecs import CODECS, Int8Blocks, TopK


def _ups(rows):
    return [{"a": torch.tensor(r[:2], dtype=torch.float32), "b": torch.tensor(r[2:], dtype=torch.float32)} for r in rows]


def test_coordinate_median_and_trimmed_mean_against_numpy():
    rng = np.random.default_rng(0)
    for k in (3, 4, 7, 8):
        rows = rng.normal(size=(k, 5)).round(2)
        rows[1] = rows[0]  # a duplicated client
        ups = _ups(rows)
        med = robust.coordinate_median(ups)
        assert np.allclose(np.concatenate([med["a"], med["b"]]), np.median(rows, axis=0), atol=1e-6)
        for beta in (0.0, 0.2, 0.3):
            cut = int(np.floor(beta * k))
            want = np.sort(rows, axis=0)[cut:k - cut].mean(axis=0)
            got = robust.trimmed_mean(ups, beta)
            assert np.allclose(np.concatenate([got["a"], got["b"]]), want, atol=1e-6)
    with pytest.raises(ValueError, match="drops every one"):
        robust.trimmed_mean(_ups(np.zeros((2, 5))), 0.5)


def test_krum_by_hand_with_ties_and_f_at_its_bound():
    """Five clients on a line, f = 1 (K = 2f + 3): scores by hand are the sums of the K − f − 2 = 2
    nearest squared distances: x = 0, 1, 2, 10, 11 -> 0: 1+4=5, 1: 1+1=2, 2: 1+4=5, 10: 1+64=65,
    11: 1+81=82; Krum keeps client 1, Multi-Krum (m = 3) keeps 0, 1, 2; a tie between 0 and 2 goes
    to the smaller index."""
    ups = [{"w": torch.tensor([x])} for x in (0.0, 1.0, 2.0, 10.0, 11.0)]
    assert robust.krum_scores(ups, 1) == pytest.approx([5, 2, 5, 65, 82])
    assert robust.krum(ups, 1) == [1]
    assert robust.krum(ups, 1, m=3) == [0, 1, 2]
    assert robust.krum(ups, 1, m=2) == [0, 1]  # 0 and 2 tie at 5: the smaller index
    with pytest.raises(ValueError, match="2f \\+ 3 = 7"):
        robust.krum(ups, 2)  # K = 5 < 2·2 + 3


def test_norm_bound_and_median_norm_by_hand():
    ups = [{"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([6.0, 8.0])},
           {"w": torch.tensor([0.0, 0.0])}]
    assert robust.median_norm(ups) == pytest.approx(3.0)  # norms 5, 1, 10, 0 -> (1 + 5) / 2
    out, scales = robust.norm_bound(ups, 2.0)
    assert scales == pytest.approx([0.4, 1.0, 0.2, 1.0])
    assert torch.allclose(out[0]["w"], torch.tensor([1.2, 1.6])) and torch.equal(out[3]["w"], torch.zeros(2))


def test_attackers_are_seeded_and_attacks_do_what_they_say():
    a = attackers = attacks.attackers(3, 10, 0.2)
    assert len(a) == 2 and attackers == attacks.attackers(3, 10, 0.2) and attacks.attackers(3, 10, 0.0) == []
    assert attacks.attackers(4, 10, 0.2) != a or attacks.attackers(5, 10, 0.2) != a  # the seed picks them
    d = {"w": torch.tensor([1.0, -2.0])}
    assert torch.equal(attacks.attack(d, "sign_flip", 3.0)["w"], torch.tensor([-3.0, 6.0]))
    assert torch.equal(attacks.attack(d, "scale", 10.0)["w"], torch.tensor([10.0, -20.0]))
    assert torch.equal(attacks.attack(d, "same_value", 0.5)["w"], torch.tensor([0.5, 0.5]))
    g1, g2 = attacks.attack(d, "gaussian", sigma=2.0, seed=1), attacks.attack(d, "gaussian", sigma=2.0, seed=1)
    assert torch.equal(g1["w"], g2["w"]) and not torch.equal(g1["w"], d["w"])
    with pytest.raises(ValueError, match="unknown attack"):
        attacks.attack(d, "nonsense")


def test_int8_blocks_against_a_hand_computation():
    """Block [1.27, -0.635, 0] of size 3: s = 1.27/127 = 0.01, codes [127, -64, 0] (−63.5 rounds to
    even −64), read back [1.27, −0.64, 0]; a block of zeros reads back as zeros; 7 entries in blocks of
    3 cost 7 bytes of codes and 3 float32 scales."""
    x = {"w": torch.tensor([1.27, -0.635, 0.0, 0.0, 0.0, 0.0, 5.0])}
    codec = Int8Blocks(block_size=3)
    sent, res = codec.encode(x)
    assert res is None and sent.nbytes == 7 + 3 * 4
    assert sent.parts["w"]["q"].tolist() == [127, -64, 0, 0, 0, 0, 127]
    assert sent.parts["w"]["scales"].tolist() == pytest.approx([0.01, 0.0, 5.0 / 127])
    back = codec.decode(sent)["w"]
    assert back.tolist() == pytest.approx([1.27, -0.64, 0.0, 0.0, 0.0, 0.0, 5.0], abs=1e-6)


def test_half_precision_bytes_and_values():
    x = {"w": torch.tensor([[1.0, 1e-3], [3.14159, -2.0]])}
    for kind, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        codec = CODECS[kind]()  # the kind is the class: no argument can build the other one
        sent, _ = codec.encode(x)
        assert sent.nbytes == 8 and sent.parts["w"]["values"].dtype == dtype and sent.codec == kind
        back = codec.decode(sent)["w"]
        assert torch.equal(back, x["w"].to(dtype).float())


def test_topk_with_error_feedback_carries_the_residual_across_rounds():
    """ρ = 0.25 of 8 entries: k = 2. Round 1 sends the two largest (ties to the lower index) and keeps
    the rest as residual; round 2 adds that residual first, so an entry too small to be sent once is
    sent once it has accumulated; every value not sent is in the residual, exactly."""
    d1 = {"w": torch.tensor([0.5, -3.0, 0.5, 2.0, 0.1, 0.0, -0.5, 0.2])}
    codec = TopK(fraction=0.25)
    sent, res = codec.encode(d1)
    w = sent.parts["w"]
    assert sent.nbytes == 2 * 8 and w["indices"].tolist() == [1, 3] and w["values"].tolist() == [-3.0, 2.0]
    assert res["w"].tolist() == pytest.approx([0.5, 0.0, 0.5, 0.0, 0.1, 0.0, -0.5, 0.2])
    d2 = {"w": torch.tensor([0.6, 0.0, 0.0, 0.0, 0.0, 0.0, -0.6, 0.0])}
    sent2, res2 = codec.encode(d2, residual=res)
    w2 = sent2.parts["w"]
    assert w2["indices"].tolist() == [0, 6] and w2["values"].tolist() == pytest.approx([1.1, -1.1])
    back = codec.decode(sent2)["w"]
    assert torch.allclose(back + res2["w"], d2["w"] + res["w"])  # nothing lost: sent + kept = owed
    tie = {"w": torch.tensor([1.0, -1.0, 1.0, 1.0])}
    assert TopK(fraction=0.5).encode(tie)[0].parts["w"]["indices"].tolist() == [0, 1]
    assert set(CODECS) == {"none", "fp16", "bf16", "int8", "topk"}


# ----------------------------------------------------------------------------- the rules as the server runs them
def _numpy_krum(updates, f: int) -> int:
    """Krum's choice from every pairwise squared distance taken as a difference, in float64 (numpy)."""
    x = np.stack([np.concatenate([u[k].double().numpy().ravel() for k in sorted(u)]) for u in updates])
    k = len(x)
    d = np.array([[np.square(x[i] - x[j]).sum() for j in range(k)] for i in range(k)])
    scores = [np.sort(np.delete(d[i], i))[: k - f - 2].sum() for i in range(k)]
    return int(np.argmin(scores))


def test_krum_distances_are_exact_at_fifty_clients_sharing_a_large_common_part():
    """K = 50 updates share a common part of magnitude 10³ and differ by ~10⁻⁴ (10⁻⁷ of it, a few float32
    ulps): the matrix-product form of the distances (torch.cdist's above 25 clients) cancels and picks
    another client; Krum's choice must be the one the exact differences give. The hazard is shown on the
    uploads as they travel (float32), where it is certain: in float64 the product form's error is 1-2 %
    of a distance here, and whether that flips the pick depends on the CPU's kernels (it did in at
    least 2 of these 3 seeds on the AMD cores with AVX2 this suite ran on until 2026-11-29, in none on
    Intel cores with AVX512)."""
    picked_differently = 0
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        common = (torch.rand(2000, generator=g) * 2 - 1) * 1000.0
        ups = [{"w": (common + 1e-4 * torch.randn(2000, generator=g)).float()} for _ in range(50)]
        want = _numpy_krum(ups, 5)
        assert robust.krum(ups, 5) == [want]
        x = torch.stack([u["w"] for u in ups])  # float32, as uploaded
        mm = torch.cdist(x, x).pow(2)  # the hazard the rule avoids: the product form at K > 25
        scores = [float(torch.cat([mm[i, :i], mm[i, i + 1:]]).sort().values[:43].sum()) for i in range(50)]
        picked_differently += int(np.argmin(scores)) != want
    assert picked_differently >= 2  # the regime is one where the product form goes wrong


def test_multi_krum_keeping_more_than_k_minus_f_is_refused_naming_the_field(smoke_raw):
    from fedsweep.config import validate

    raw = {**smoke_raw, "clients": {**smoke_raw["clients"], "num_clients": 8},
           "server": {"robust": {"rule": "multi_krum", "f": 1, "m": 8}}}
    with pytest.raises(ValueError, match=r"server\.robust\.m=8: Multi-Krum keeps at most K − f = 8 − 1 = 7"):
        validate(raw)
    raw["server"]["robust"]["m"] = 7
    assert validate(raw).server.robust.m == 7
    ups = [{"w": torch.tensor([float(x)])} for x in range(8)]
    with pytest.raises(ValueError, match="m must be at most K − f"):
        robust.krum(ups, 1, m=8)


def test_a_weight_inflating_attacker_buys_no_weight_back_after_the_rule(smoke_raw):
    """Norm bounding shrinks the attacker's update, but the attacker reports 10⁶ examples: FedAvg after
    the rule weighs clients by the counts the server assigned (10 each here), so the global is the plain
    mean of the clipped updates (numpy), not one dominated by the attacker."""
    from fedsweep.algorithms import registry
    from fedsweep.algorithms.types import ClientInfo, ClientResult, Payload, ServerState, Upload
    from fedsweep.config import validate
    from fedsweep.federation.chain import ServerChain

    cfg = validate({**smoke_raw, "server": {"robust": {"rule": "norm_bound", "bound": 1.0},
                                            "max_update_ratio": 1e6}})
    algo = registry.create("fedavg", cfg.algo_params)
    chain = ServerChain(cfg, [ClientInfo(cid=c, num_examples=10) for c in range(4)])
    glob = {"w": torch.zeros(3)}
    deltas = [np.array([0.3, 0.0, 0.4]), np.array([0.0, 0.5, 0.0]), np.array([0.2, 0.2, 0.2]), np.array([-30.0, 0, 40])]
    claimed = [10, 10, 10, 1_000_000]
    results = [ClientResult(cid=c, num_examples=n, upload=Upload(params={"w": torch.tensor(d, dtype=torch.float32)}))
               for c, (d, n) in enumerate(zip(deltas, claimed))]
    sent = chain.open(1, lambda answering: {c: Payload(params=glob) for c in answering},
                      ServerState(globals=dict(glob)))
    closed = chain.close(1, {r.cid: chain.receive(r, sent) for r in results}, {}, sent)
    kept = closed.kept
    assert closed.left_out == [] and closed.rejected == {} and closed.metrics["robust_clipped"] == 1.0
    assert [r.num_examples for r in kept] == [10, 10, 10, 10]
    state, _ = algo.aggregate(1, kept, ServerState(globals=dict(glob)), closed.context)
    clipped = [d * min(1.0, 1.0 / np.linalg.norm(d)) for d in deltas]
    np.testing.assert_allclose(state.globals["w"].numpy(), np.mean(clipped, axis=0), rtol=0, atol=1e-6)
    by_claim = np.average(clipped, axis=0, weights=claimed)  # what weighing by reported counts would give
    assert np.abs(by_claim - np.mean(clipped, axis=0)).max() > 0.3
    assert results[3].num_examples == 1_000_000  # the client's own report is left as it came


def test_a_coordinate_wise_rule_takes_the_place_of_the_methods_mean_without_editing_uploads(smoke_raw):
    """FedAvgM under the median: its pseudo-gradient is median_k θ_k − θ_g (numpy), the server's chain
    handing the median to the method in its aggregation context; every upload the method received is
    still the client's own."""
    from fedsweep.algorithms import registry
    from fedsweep.algorithms.types import PLAIN, ClientInfo, ClientResult, Payload, ServerState, Upload
    from fedsweep.config import validate
    from fedsweep.federation.chain import ServerChain

    cfg = validate({**smoke_raw, "algorithm": "fedavgm", "clients": {**smoke_raw["clients"], "num_clients": 5},
                    "server": {"robust": {"rule": "median"}, "max_update_ratio": 1e6}})
    algo = registry.create("fedavgm", cfg.algo_params)
    chain = ServerChain(cfg, [ClientInfo(cid=c, num_examples=10) for c in range(5)])
    rows = np.array([[1.0, 2.0], [1.5, -1.0], [100.0, 3.0], [0.5, 0.0], [1.2, -50.0]], dtype=np.float32)
    uploads = [{"w": torch.tensor(r)} for r in rows]
    results = [ClientResult(cid=c, num_examples=10, upload=Upload(params=u)) for c, u in enumerate(uploads)]
    glob = {"w": torch.zeros(2)}
    sent = chain.open(1, lambda answering: {c: Payload(params=glob) for c in answering},
                      ServerState(globals=glob))
    closed = chain.close(1, {r.cid: chain.receive(r, sent) for r in results}, {}, sent)
    assert [r.cid for r in closed.kept] == list(range(5)) and closed.context.mean is not PLAIN.mean
    state, _ = algo.aggregate(1, closed.kept, ServerState(globals={"w": torch.zeros(2)}), closed.context)
    assert not hasattr(algo, "mean")  # the rule travels in the context: nothing is assigned onto the method
    hp = cfg.algo_params
    np.testing.assert_allclose(state.globals["w"].numpy(), hp.server_lr * np.median(rows, axis=0), rtol=1e-6)
    assert all(r.upload.params is u for r, u in zip(closed.kept, uploads))
