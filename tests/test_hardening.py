"""Property-based: mutated experiment files and data files end in exit 2 with exactly one line
(naming what is wrong), or validate — never a traceback."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsweep import cli

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["smoke.yaml", "fedicu.yaml", "drift_sp.yaml", "fedreft_distinct.yaml", "pfedgpt.yaml", "fedcofit.yaml",
           "scaffold.yaml"]

WEIRD = st.one_of(
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(max_size=20), st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2), st.just(1e30), st.just(-1), st.just(0),
)


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


def _run_validate(path: Path, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(["validate", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _check(rc: int, err: str) -> None:
    assert rc in (0, 2), rc
    if rc == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        # one line per problem the file has (every problem at once), each an error line, nothing else
        assert lines and all(line.startswith("error: ") for line in lines), err
        assert "Traceback" not in err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(SHIPPED), data=st.data())
def test_mutated_shipped_configs_fail_in_one_line_or_validate(tmp_path, capsys, name, data):
    raw = yaml.safe_load((ROOT / "configs" / "experiments" / name).read_text())
    raw["data"] = {**raw.get("data", {}), "examples_per_task": 8}  # keep partitioning cheap
    raw.setdefault("clients", {})["num_clients"] = 2
    mutated = copy.deepcopy(raw)
    paths = sorted(_paths(mutated), key=str)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        node = mutated
        for k in path[:-1]:
            node = node[k] if isinstance(node, dict) and isinstance(node.get(k), dict) else None
            if node is None:
                break
        if node is not None:
            if data.draw(st.booleans()):
                node[path[-1]] = data.draw(WEIRD)
            else:
                node.pop(path[-1], None)
    text = yaml.safe_dump(mutated, allow_unicode=True)
    blob = text.encode()
    if data.draw(st.booleans()):  # byte-level damage too: Latin-1 or invalid bytes, truncation
        pos = data.draw(st.integers(0, len(blob)))
        blob = blob[:pos] + data.draw(st.sampled_from([b"\xe9", b"\xff\xfe", b"", b":", b"\x00", b"[", b"\n  - "])) + \
            blob[pos + data.draw(st.integers(0, 3)):]
    f = tmp_path / "mut.yaml"
    f.write_bytes(blob)
    rc, _, err = _run_validate(f, capsys)
    _check(rc, err)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_data_files_fail_in_one_line_or_validate(tmp_path, capsys, data):
    from fedsweep.data import bundled

    recs = bundled.generate(["basic_arithmetic", "gcd"], 6, 0)
    lines = [json.dumps({"prompt": r["prompt"], "response": r["response"], "task": r["task"]}).encode() for r in recs]
    i = data.draw(st.integers(0, len(lines) - 1))
    kind = data.draw(st.sampled_from(["bytes", "field", "nest", "big", "drop"]))
    if kind == "bytes":
        pos = data.draw(st.integers(0, len(lines[i])))
        lines[i] = lines[i][:pos] + data.draw(st.sampled_from([b"\xe9", b"\xff", b"\"", b"{", b"\x00"])) + lines[i][pos:]
    elif kind == "field":
        rec = json.loads(lines[i])
        rec[data.draw(st.sampled_from(["prompt", "response", "task"]))] = data.draw(WEIRD)
        lines[i] = json.dumps(rec).encode()
    elif kind == "nest":
        depth = data.draw(st.integers(1, 3000))
        lines[i] = lines[i][:-1] + b', "meta": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "big":
        lines[i] = json.dumps({"prompt": "x" * data.draw(st.integers(1, 3_000_000)), "response": "y"}).encode()
    else:
        lines = lines[:i]
    df = tmp_path / "d.jsonl"
    df.write_bytes(b"\n".join(lines) + b"\n")
    cfg = {"name": "j", "model": {"name": "tiny"}, "data": {"source": "jsonl", "path": str(df), "tasks": ["gcd"],
                                                            "test_fraction": 0.25, "holdout_fraction": 0.0},
           "partition": {"scheme": "iid", "min_examples": 1}, "clients": {"num_clients": 2}}
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(cfg))
    rc, _, err = _run_validate(f, capsys)
    _check(rc, err)


def test_the_checks_are_not_vacuous(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nrounds: true\n")
    rc, _, err = _run_validate(f, capsys)
    assert rc == 2 and "rounds" in err and len(err.strip().splitlines()) == 1


def test_keys_with_line_breaking_or_markup_characters_stay_on_their_one_line(tmp_path, capsys):
    """Found by the property test above: a key holding U+001E (which ``str.splitlines`` breaks on) split
    its error in two. Such characters are shown escaped, and rich markup in a key is shown as typed."""
    f = tmp_path / "odd.yaml"
    f.write_text(yaml.safe_dump({"name": "x", "clients": {"resources": {"\x1e": 0, "[red]x[/]": 1, "a\nb": 2}}}))
    rc, _, err = _run_validate(f, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 3 and all(line.startswith("error: ") for line in lines), err
    assert "'clients.resources.\\x1e'" in err and "'clients.resources.a\\nb'" in err
    assert "'clients.resources.[red]x[/]'" in err


# ---------------------------------------------------------------- divergence detection


def _result(cid, params, loss=1.0, first=1.0, last=1.0):
    import torch  # noqa: F401

    from fedsweep.algorithms.types import ClientResult, Upload

    return ClientResult(cid, 10, Upload(params=params),
                        metrics={"train_loss": loss, "train_loss_first": first, "train_loss_last": last})


def test_screen_rejects_diverged_exploding_and_nonfinite_clients_only():
    import numpy as np
    import torch

    from fedsweep.federation.screening import screen

    start = {"w": torch.zeros(4)}
    ups = {0: {"w": torch.tensor([1.0, 0, 0, 0])}, 1: {"w": torch.tensor([0, 2.0, 0, 0])},
           2: {"w": torch.tensor([0, 0, 1.5, 0])}, 3: {"w": torch.tensor([0, 0, 0, 500.0])},
           4: {"w": torch.tensor([0, float("nan"), 0, 0])}, 5: {"w": torch.tensor([0.5, 0.5, 0, 0])},
           6: {"w": torch.tensor([0.1, 0, 0, 0])}}
    results = {c: _result(c, p) for c, p in ups.items()}
    results[5] = _result(5, ups[5], first=2.0, last=25.0)  # exploded
    results[6] = _result(6, ups[6], loss=float("inf"))
    why = screen(results, {c: start for c in ups}, max_update_ratio=100.0, max_loss_ratio=10.0)
    assert set(why) == {3, 4, 5, 6}
    assert "norm" in why[3] and "non-finite values" in why[4] and "exploded" in why[5] and "non-finite training" in why[6]
    # the ratio is to the median of the *other* clients, by hand
    norms = {0: 1.0, 1: 2.0, 2: 1.5, 3: 500.0}
    assert 500.0 / np.median([1.0, 2.0, 1.5]) > 100 and all(
        n / np.median([m for c, m in norms.items() if c != k]) < 100 for k, n in norms.items() if k != 3)
    # two clients: one diverged is still caught (leave-one-out), and a tolerant ratio lets it pass
    two = {0: _result(0, {"w": torch.ones(4)}), 1: _result(1, {"w": torch.ones(4) * 1e4})}
    assert set(screen(two, {}, 100.0, 10.0)) == {1}
    assert screen(two, {}, 1e6, 10.0) == {}
    # every client diverged alike: no outlier among them, but each update dwarfs its start
    start = {"w": torch.full((4,), 0.1)}  # ‖start‖ = 0.2
    alike = {c: _result(c, {"w": torch.full((4,), 4.0 + c)}) for c in range(3)}  # ‖Δ‖ ≈ 8 < 100 × 0.2
    assert screen(alike, {c: start for c in alike}, 100.0, 10.0) == {}
    alike = {c: _result(c, {"w": torch.full((4,), 400.0 + c)}) for c in range(3)}  # ‖Δ‖ ≈ 800 > 20
    why = screen(alike, {c: start for c in alike}, 100.0, 10.0)
    assert set(why) == {0, 1, 2} and all("started from" in w for w in why.values())


def test_update_norms_match_a_float64_sum_by_hand_in_the_hard_regimes():
    """The norms screening rests on (one float64 vector per client, the shared start laid out once)
    against a per-tensor float64 sum in numpy: near-identical and identical clients, tensors the
    start lacks or shapes differently, mixed dtypes, float32 values whose squares overflow float32,
    and a start shared by reference next to an equal copy of it."""
    import math

    import numpy as np
    import torch

    from fedsweep.federation.screening import screen, update_norms

    g = torch.Generator().manual_seed(3)
    start = {"a": torch.randn(4, 5, generator=g), "b": torch.randn(7, generator=g) * 1e3, "c": torch.randn(3, 2, generator=g)}
    ups = {
        0: {k: v + 1e-6 * torch.randn(v.shape, generator=g) for k, v in start.items()},  # near-identical
        1: {k: v.clone() for k, v in start.items()},  # identical: exactly zero
        2: {"a": start["a"] * 2, "b": torch.randn(8, generator=g), "d": torch.randn(2, generator=g)},  # b reshaped, d new
        3: {"a": start["a"].to(torch.bfloat16), "b": start["b"].half(), "c": start["c"].double()},  # mixed dtypes
        4: {k: torch.full_like(v, 3e37) for k, v in start.items()},  # squares overflow float32
        5: {"c": torch.randn(3, 2, generator=g)},  # no start at all
    }
    copy = {k: v.clone() for k, v in start.items()}
    starts = {0: start, 1: start, 2: start, 3: start, 4: copy}

    def by_hand(up, st):
        squares = []
        for k, v in up.items():
            x = v.double().numpy()
            if st is not None and k in st and tuple(st[k].shape) == tuple(v.shape):
                x = x - st[k].double().numpy()
            squares += (x.astype(np.float64) ** 2).ravel().tolist()
        return math.sqrt(math.fsum(squares))

    norms, sizes = update_norms({c: _result(c, p) for c, p in ups.items()}, starts)
    assert set(norms) == set(ups) and set(sizes) == {0, 1, 2, 3, 4}
    for c, up in ups.items():
        assert norms[c] == pytest.approx(by_hand(up, starts.get(c)), rel=1e-12, abs=0.0), c
    assert norms[1] == 0.0 and 0 < norms[0] < 1e-4 and math.isfinite(norms[4])
    want_size = by_hand(start, None)
    assert all(sizes[c] == pytest.approx(want_size, rel=1e-12) for c in sizes)

    # a non-finite value is named (the first such tensor in upload order); a float64 value whose
    # square overflows is finite, not "non-finite", and still rejected for its norm
    bad = {"a": start["a"].clone(), "b": start["b"].clone(), "c": start["c"].clone()}
    bad["b"][3], bad["c"][0, 1] = float("inf"), float("nan")
    huge = {k: v.double() for k, v in start.items()}
    huge["a"][0, 0] = 1e200
    calm = {c: _result(c, {k: v + 0.01 for k, v in start.items()}) for c in range(4)}
    why = screen({**calm, 7: _result(7, bad), 8: _result(8, huge)}, {c: start for c in (0, 1, 2, 3, 7, 8)}, 100.0, 10.0)
    assert why[7] == "update rejected: non-finite values in b"
    assert "non-finite" not in why[8] and "norm inf" in why[8]
    assert set(why) == {7, 8}


def test_a_round_where_every_client_diverges_stops_in_one_line(ray_session, smoke_raw, tmp_path, monkeypatch):
    """Round 2's every update diverges: the run stops in one line, and round 1, whose files were being
    written while round 2 trained (checkpoint.overlap), is committed intact. The server holds round
    1's commit until the round thread asks for it (``hold_commit``), and round 2 fails before its
    checkpoint asks: only the tear-down's flush commits round 1."""
    from fedsweep import checkpoint as ckpt
    from fedsweep.actors.probe import PROBE_ENV as FAULT_ENV
    from fedsweep.config import validate
    from fedsweep.orchestrator.runner import RunError, run

    smoke_raw["rounds"] = 2
    smoke_raw["tracking"]["enabled"] = False
    smoke_raw["checkpoint"] = {"dir": str(tmp_path / "runs")}
    held = tmp_path / "held"
    faults = [f"poison:2:{c}:{tmp_path / f'fired{c}'}" for c in range(4)] + [f"hold_commit:1:0:{held}"]
    monkeypatch.setenv(FAULT_ENV, ";".join(faults))
    with pytest.raises(RunError) as err:
        run(validate(smoke_raw))
    assert "round 2" in str(err.value) and "no client update was usable" in str(err.value)
    assert "\n" not in str(err.value)
    assert held.exists()  # the commit was held: round 2 failed while round 1 was not committed
    (checkpoints,) = (tmp_path / "runs").glob("*/*/checkpoints")
    assert ckpt.complete_rounds(checkpoints) == [1] and not list(checkpoints.glob("*.partial"))
    assert ckpt.verify(ckpt.latest(checkpoints)) is None


def test_unexpected_errors_are_one_line_and_debug_shows_the_trace(capsys, monkeypatch):
    from fedsweep import cli
    from fedsweep.cli.commands import algorithms

    def boom(args):
        raise OSError("disk on fire\nsecond line of detail")

    monkeypatch.setattr(algorithms, "cmd_algorithms", boom)
    assert cli.main(["algorithms"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fedsweep algorithms" in err and "OSError" in err
    with pytest.raises(OSError):
        cli.main(["--debug", "algorithms"])


def test_norms_measured_as_the_calls_answer_equal_those_measured_at_once():
    """The server measures each training call's results as it answers (``UpdateNorms.add``);
    screening then measures only what was not added. Same norms, same verdicts as measuring all
    at once, in any batching; a client whose result was replaced (trained again) is measured anew."""
    import torch

    from fedsweep.federation.screening import UpdateNorms, screen, update_norms

    g = torch.Generator().manual_seed(5)
    start = {"a": torch.randn(6, 3, generator=g), "b": torch.randn(4, generator=g)}
    ups = {c: {k: v + 0.01 * (c + 1) * torch.randn(v.shape, generator=g) for k, v in start.items()} for c in range(9)}
    ups[4] = {k: v * 1e4 for k, v in start.items()}  # rejected by the others' median
    ups[6] = {k: v.clone() for k, v in start.items()}  # identical to its start: zero
    results = {c: _result(c, p) for c, p in ups.items()}
    results[8] = _result(8, None)  # no parameters uploaded
    starts = {c: start for c in results}
    at_once = update_norms(results, starts)
    want = screen(results, starts, 100.0, 10.0)
    assert set(want) == {4}
    assert screen(results, starts, 100.0, 10.0, UpdateNorms(starts)) == want
    for batches in ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [[8], [0], [5, 3, 1]], [[]]):
        measured = UpdateNorms(starts)
        for batch in batches:
            measured.add({c: results[c] for c in batch})
        assert screen(results, starts, 100.0, 10.0, measured) == want  # measures what was not added
        assert measured.of(results) == at_once

    measured = UpdateNorms(starts)
    measured.add(results)
    again = dict(results)
    again[4] = _result(4, {k: v + 0.02 for k, v in start.items()})  # client 4 trained again: now calm
    assert measured.of(again)[0][4] == update_norms({4: again[4]}, starts)[0][4] != at_once[0][4]
    assert screen(again, starts, 100.0, 10.0, measured) == {}
