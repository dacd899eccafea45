"""Robust aggregation rules, attacks and compressed uploads against independent computations
(numpy and hand-computed values), in the hard cases: ties, even counts, f at its bound, blocks of
zeros, equal magnitudes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep.algorithms import attacks, compression, robust


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
    sent, nbytes, res = compression.compress(x, "int8", block_size=3)
    assert res is None and nbytes == 7 + 3 * 4
    assert sent["w#q"].tolist() == [127, -64, 0, 0, 0, 0, 127]
    assert sent["w#s"].tolist() == pytest.approx([0.01, 0.0, 5.0 / 127])
    back = compression.decompress(sent, {"w": (7,)}, "int8", block_size=3)["w"]
    assert back.tolist() == pytest.approx([1.27, -0.64, 0.0, 0.0, 0.0, 0.0, 5.0], abs=1e-6)


def test_half_precision_bytes_and_values():
    x = {"w": torch.tensor([[1.0, 1e-3], [3.14159, -2.0]])}
    for kind, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        sent, nbytes, _ = compression.compress(x, kind)
        assert nbytes == 8 and sent["w"].dtype == dtype
        back = compression.decompress(sent, {"w": (2, 2)}, kind)["w"]
        assert torch.equal(back, x["w"].to(dtype).float())


def test_topk_with_error_feedback_carries_the_residual_across_rounds():
    """ρ = 0.25 of 8 entries: k = 2. Round 1 sends the two largest (ties to the lower index) and keeps
    the rest as residual; round 2 adds that residual first, so an entry too small to be sent once is
    sent once it has accumulated; every value not sent is in the residual, exactly."""
    d1 = {"w": torch.tensor([0.5, -3.0, 0.5, 2.0, 0.1, 0.0, -0.5, 0.2])}
    sent, nbytes, res = compression.compress(d1, "topk", fraction=0.25)
    assert nbytes == 2 * 8 and sent["w#i"].tolist() == [1, 3] and sent["w#v"].tolist() == [-3.0, 2.0]
    assert res["w"].tolist() == pytest.approx([0.5, 0.0, 0.5, 0.0, 0.1, 0.0, -0.5, 0.2])
    d2 = {"w": torch.tensor([0.6, 0.0, 0.0, 0.0, 0.0, 0.0, -0.6, 0.0])}
    sent2, _, res2 = compression.compress(d2, "topk", fraction=0.25, residual=res)
    assert sent2["w#i"].tolist() == [0, 6] and sent2["w#v"].tolist() == pytest.approx([1.1, -1.1])
    back = compression.decompress(sent2, {"w": (8,)}, "topk")["w"]
    assert torch.allclose(back + res2["w"], d2["w"] + res["w"])  # nothing lost: sent + kept = owed
    tie = {"w": torch.tensor([1.0, -1.0, 1.0, 1.0])}
    assert compression.compress(tie, "topk", fraction=0.5)[0]["w#i"].tolist() == [0, 1]
