"""``fedsweep bench faults``: the kill plan, and the whole check on the tiny model — a client actor,
the server actor and the driver killed in one run, which must end bitwise where the undisturbed one
ends, each fault's recovery named and its cost measured."""

from __future__ import annotations

import json

import pytest

from fedsweep.bench.recovery import KINDS, plan


def test_the_plan_spreads_every_kind_over_the_rounds_and_is_seeded():
    kills = plan(20, 6, seed=3)
    assert len(kills) == 6 and sorted(k.kind for k in kills) == sorted(KINDS * 2)
    assert [k.round for k in kills] == sorted(k.round for k in kills)
    assert all(1 <= k.round <= 20 for k in kills) and max(k.round for k in kills) - min(k.round for k in kills) >= 10
    assert all(k.round < 20 for k in kills if k.kind == "driver")  # a stop after the last round resumes nothing
    assert plan(20, 6, seed=3) == kills and plan(20, 6, seed=4) != kills
    assert plan(1, 1, seed=0)[0].kind in ("client", "server")
    assert plan(5, 0, seed=0) == []
    with pytest.raises(ValueError):
        plan(5, -1, seed=0)


@pytest.mark.xdist_group("ray_heavy")
@pytest.mark.system
def test_bench_faults_on_the_tiny_model_recovers_bitwise(ray_session, tmp_path, capsys):
    from fedsweep.cli import main

    code = main(["bench", "faults", "configs/experiments/smoke.yaml", "--set", "rounds=4", "--set", "eval.max_new_tokens=0",
                 "--kills", "3", "--seed", "0", "--scratch", str(tmp_path / "scratch"), "--out", str(tmp_path)])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    result = json.loads((tmp_path / "faults_smoke_k4.json").read_text())
    assert result["bitwise_equal"] and result["tensors"] > 100
    assert {k["kind"] for k in result["kills"]} == set(KINDS)
    assert all(k["landed"] != "not fired" and k["recovered"] for k in result["kills"])
    server = next(k for k in result["kills"] if k["kind"] == "server")
    assert server["recovered"].startswith("replaced from round")
    driver = next(k for k in result["kills"] if k["kind"] == "driver")
    assert driver["recovered"] == f"resumed from round {driver['round']}" and driver["cost_s"] is not None
    assert "bitwise equal" in out and not (tmp_path / "scratch").exists()


def test_committed_names_the_run_folder_that_holds_the_checkpoints(tmp_path):
    """The outage kinds read a run's final state from what ``committed`` returns: the run's own folder
    (``…/RUN/checkpoints/round_N/COMPLETE`` → ``…/RUN``), only where round N carries its COMPLETE."""
    from fedsweep.bench.outages import committed

    run = tmp_path / "runs" / "smoke" / "20261129-005840"
    (run / "checkpoints" / "round_0001").mkdir(parents=True)
    (run / "checkpoints" / "round_0001" / "COMPLETE").write_text("")
    (run / "checkpoints" / "round_0002").mkdir()  # written, not committed
    assert committed(tmp_path / "runs", 1) == [run]
    assert committed(tmp_path / "runs", 2) == []
