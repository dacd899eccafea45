"""Traffic that does not grow with clients: a client actor sends one weighted partial sum of its
clients' uploads (``server.partial_sums``) where the method reads them only through their mean.
The mean equals the mean of each upload (float64 within 1e-12, float32 within 1e-6, relative), and a
client screening rejects makes the round fall back to each upload."""

from __future__ import annotations

import pytest
import torch

from fedsweep.algorithms.tensors import weighted_mean
from fedsweep.algorithms.types import ClientResult, Upload
from fedsweep.federation.chain import partial_mean, partial_sum

from test_lockstep import BASE, _merge, _relative, two_rounds  # noqa: E402  (the lockstep harness)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_partial_sums_give_the_weighted_mean_of_the_uploads(dtype, tolerance):
    """50 clients in 3 actors' partial sums (in float64) against ``weighted_mean`` over every upload,
    on adapters of a SmolLM2-135M LoRA's size order (q, v: 30 layers × 2 × (576·8 + 8·576))."""
    gen = torch.Generator().manual_seed(0)
    shape = {f"layer{i}.{m}": (8, 576) if m == "A" else (576, 8) for i in range(30) for m in ("A", "B")}
    uploads = [{k: (torch.randn(s, generator=gen) * 0.05 + 0.3).to(dtype) for k, s in shape.items()} for _ in range(50)]
    counts = torch.randint(20, 200, (50,), generator=gen).tolist()
    want = weighted_mean(uploads, counts)
    actors = [range(0, 17), range(17, 34), range(34, 50)]
    partials = [partial_sum([(c, counts[c], uploads[c]) for c in a]) for a in actors]
    kept = [ClientResult(c, counts[c], Upload()) for c in range(50)]
    got = partial_mean(partials, kept)([None] * 50, counts)
    assert got.keys() == want.keys() and all(got[k].dtype == dtype for k in got)
    worst = max(_relative(got[k], want[k]) for k in want)
    assert worst <= tolerance, worst
    with pytest.raises(ValueError, match="another mean"):
        partial_mean(partials, kept)([None] * 50, [1.0] * 50)  # a method weighing otherwise is caught


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("float32", 1e-6)])
def test_fedavg_through_the_server_with_partial_sums_equals_each_upload(ray_session, tmp_path, dtype, tolerance):
    """Two rounds of FedAvg through the ServerActor with partial sums and without: every client's adapter
    after round 2 (it started from round 2's global) equal within the tolerance; the partial-sum rounds
    moved no upload (each result's upload empty, its norms measured where it trained)."""
    raw = _merge(BASE, {"model": {"dtype": dtype}, "algorithm": "fedavg"})
    each, _ = two_rounds(_merge(raw, {"server": {"partial_sums": False}}), tmp_path / "each")
    summed, rounds = two_rounds(raw, tmp_path / "summed")
    worst = max(_relative(summed.slots[c].params[k], each.slots[c].params[k])
                for c in each.slots for k in each.slots[c].params)
    assert worst <= tolerance, worst
    assert summed._uploads[0] == 2 and set(summed._uploads[1]) == set(summed.slots)


@pytest.mark.parametrize("batching", ["auto", "off"])
def test_a_client_screening_rejects_makes_the_round_fall_back_to_each_upload(ray_session, tmp_path, monkeypatch, batching):
    """A diverged client (its update ×10⁴ after training) in a partial-sum round: screening rejects it from
    the norms its actor measured, the server asks the actor for the uploads, and the round's global is the
    mean of the others' uploads, as without partial sums. With the clients trained one at a time
    (``off``) the actor's clients come in several calls, and it keeps every call's uploads of the round,
    not only the last call's."""
    from fedsweep.actors import probe

    marker = tmp_path / "poisoned"
    monkeypatch.setenv(probe.PROBE_ENV, f"poison:1:1:{marker}")
    raw = _merge(BASE, {"model": {"dtype": "float64"}, "algorithm": "fedavg", "train": {"batch_clients": batching}})
    each, each_rounds = _poisoned(_merge(raw, {"server": {"partial_sums": False}}), tmp_path / "each", marker)
    summed, rounds = _poisoned(raw, tmp_path / "summed", marker)
    for r in (each_rounds, rounds):
        assert "update rejected" in r[0]["failures"][1]
    worst = max(_relative(summed.slots[c].params[k], each.slots[c].params[k])
                for c in each.slots for k in each.slots[c].params)
    assert worst <= 1e-12, worst


def _poisoned(raw, folder, marker):
    from fedsweep.actors.probe import probe_from_env

    if marker.exists():
        marker.unlink()
    import test_lockstep

    original = test_lockstep.client_actor

    def probed(cfg, hosted, *args, **kw):
        return original(cfg, hosted, *args, probe=probe_from_env(), **kw)

    test_lockstep.client_actor = probed
    try:
        return two_rounds(raw, folder)
    finally:
        test_lockstep.client_actor = original


@pytest.mark.parametrize("change, summed", [
    ({}, True), ({"algorithm": "fedadam"}, True), ({"algorithm": "fedprox"}, True), ({"algorithm": "ffa_lora"}, True),
    ({"server": {"partial_sums": False}}, False),
    ({"algorithm": "drift", "data": {"kind": "preference"}, "train": {"objective": "dpo"}}, False),  # personalised
    ({"algorithm": "scaffold"}, False),  # its control variates travel with each upload
    ({"clients": {"num_clients": 6}, "server": {"robust": {"rule": "krum"}}}, False),  # a rule needs each update
    ({"clients": {"upload": {"compression": "int8"}}}, False),
    ({"clients": {"num_clients": 5, "byzantine": {"fraction": 0.2}}}, False),
])
def test_partial_sums_only_where_nothing_needs_each_upload(change, summed):
    from fedsweep.algorithms import registry
    from fedsweep.config import validate
    from fedsweep.federation.chain import ServerChain

    raw = _merge(BASE, change)
    cfg = validate(raw)
    assert ServerChain.takes_partial_sums(cfg, registry.capabilities(cfg.algorithm)) is summed
