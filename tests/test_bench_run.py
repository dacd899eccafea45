"""``fedsweep bench run``: every phase and round part written, the parts adding up, the clock it starts from."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from fedsweep.bench.run import round_breakdown
from fedsweep.process_start import process_start_epoch


def test_a_process_start_is_read_to_the_clock_tick():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    after = time.time()
    try:
        start = process_start_epoch(child.pid)
    finally:
        child.kill()
        child.wait()
    assert before - 0.03 <= start <= after + 0.03  # one clock tick is 10 ms
    assert process_start_epoch() <= time.time()


def test_pss_is_read_from_the_kernels_summary_as_psutil_reads_it():
    import psutil

    from fedsweep.bench.run import TreeRSS, process_pss

    me = psutil.Process()
    assert process_pss(me) == pytest.approx(me.memory_full_info().pss, abs=2 ** 20)  # (the heap moves a little)
    tree = TreeRSS(pss_every=3)
    tree.sample(pss=False)
    assert tree.peak >= me.memory_info().rss - 2 ** 20 and tree.peak_pss == 0  # RSS alone: PSS not read
    tree.sample()
    assert 0 < tree.peak_pss <= tree.peak + 2 ** 20
    before, outside = tree.cpu_s, time.thread_time()
    tree.sample()
    outside = time.thread_time() - outside
    assert 0 < tree.cpu_s - before <= outside  # the sample's own CPU time, within what this thread spent on the call
    assert tree.peaks_mib()["sampler_cpu_s"] == round(tree.cpu_s, 3)


def test_a_round_is_split_into_its_parts_by_hand():
    summary = {"evaluated": False, "metrics": {"round_seconds": 2.0, "train_seconds": 1.5,
                                                "busiest_actor_train_seconds": 1.2, "aggregation_seconds": 0.3,
                                                "checkpoint_seconds": 0.1}}
    parts = round_breakdown(summary)
    assert parts["busiest_actor_train"] == 1.2 and parts["eval"] == 0.0
    assert parts["overhead"] == pytest.approx(2.0 - 1.2 - 0.3 - 0.1)
    assert parts["overhead_share_without_eval"] == pytest.approx(0.4 / 2.0)
    summary = {"evaluated": True, "metrics": {"round_seconds": 3.0, "train_seconds": 1.0, "eval_seconds": 1.0}}
    parts = round_breakdown(summary)  # no busiest actor reported: the train seconds are its
    assert parts["overhead"] == pytest.approx(1.0) and parts["overhead_share_without_eval"] == pytest.approx(0.5)
    assert parts["evaluated"] is True


def test_bench_run_writes_every_phase_and_round(ray_session, smoke_raw, tmp_path):
    from fedsweep.bench.run import bench_run, write

    smoke_raw["rounds"] = 2
    smoke_raw["eval_every"] = 2  # round 1 unevaluated: it gives the overhead share
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump(smoke_raw))
    started = time.time()
    result = bench_run(str(config), ["train.steps=2"], started=started)
    ended = time.time()
    assert result["clients"] == 4 and result["rounds"] == 2 and result["tracking"] is True
    phases = result["phases_s"]
    for name in ("driver_imports", "config_and_ray_start", "data", "tracking", "layout", "actors", "setup",
                 "rounds", "teardown"):
        assert phases[name] >= 0.0, name
    assert phases["actors"] <= phases["setup"]
    # (the ideal's rates are measured after the run, outside its total)
    assert result["total_wall_s"] == pytest.approx(ended - started - result["ideal"]["measured_in_s"], abs=0.5)
    sequential = phases["driver_imports"] + phases["config_and_ray_start"] + phases["setup"] + phases["rounds"] \
        + phases["teardown"]
    assert sequential <= result["total_wall_s"] + 1e-6
    assert [r["evaluated"] for r in result["per_round"]] == [False, True]
    for r in result["per_round"]:
        assert 0.0 < r["busiest_actor_train"] <= r["train"] + 1e-9
        assert r["overhead"] == pytest.approx(r["round"] - r["busiest_actor_train"] - r["aggregation"] - r["eval"]
                                              - r["checkpoint"])
    assert result["overhead_share_without_eval_median"] == result["per_round"][0]["overhead_share_without_eval"]
    assert len(result["client_actor_starts_s"]) == result["num_actors"]
    for t in result["client_actor_starts_s"]:
        assert t["process_start"] <= t["module_ready"] <= t["init_start"] <= t["init_end"]
    # each client actor was built with its collector paused, and froze what it built (torch and the
    # model: far more than this module's imports alone)
    assert len(result["client_actor_frozen_objects"]) == result["num_actors"]
    assert all(n > 100_000 for n in result["client_actor_frozen_objects"]), result["client_actor_frozen_objects"]
    from fedsweep.orchestrator import preflight

    assert not preflight.store_prepared(smoke_raw["tracking"]["uri"])  # the store prepared while Ray started was taken
    assert result["peak_rss_tree_mib"] > 100  # the driver with torch imported is more than that alone
    # PSS splits shared pages: never more than RSS, and the driver's own torch is still most of it
    assert 100 < result["peak_pss_tree_mib"] <= result["peak_rss_tree_mib"]
    assert 0 < result["sampler_cpu_s"] < result["total_wall_s"]  # the sampling's own cost, reported
    # the run against its ideal (the bare rates measured here after it) and its traffic
    ideal = result["ideal"]
    rates = ideal["rates"]
    assert all(rates[k] > 0 for k in ("train_tokens_per_s", "forward_tokens_per_s", "generate_tokens_per_s"))
    for key in ("train_tokens_per_s", "forward_tokens_per_s", "generate_tokens_per_s"):  # the best of both loops
        assert rates[key] == max(rates["bare"][key], rates["engine"][key])
    from fedsweep.config import validate
    from fedsweep.orchestrator.experiment_data import prepare_clients

    prompts = sum(len(c.test) for c in prepare_clients(validate(smoke_raw))[0])  # every test record answered
    for r in result["per_round"]:
        want = r["train_tokens"] / rates["train_tokens_per_s"] + r["aggregation"]  # (the server's arithmetic: as measured)
        if r["evaluated"]:
            assert r["work"]["test_tokens"] > 0 and r["work"]["eval_new_tokens"] == 8 * prompts  # prompts × max_new_tokens
            want += r["work"]["test_tokens"] / rates["forward_tokens_per_s"] + \
                r["work"]["eval_new_tokens"] / rates["generate_tokens_per_s"]
        else:
            assert r["work"]["test_tokens"] == 0
        assert r["ideal_s"] == pytest.approx(want) and r["over_ideal"] == pytest.approx(r["round"] / want)
        assert sum(r["phases"].values()) == pytest.approx(r["round"])  # the phases make up the round
        assert r["traffic_bytes"] >= 2 * result["adapter_bytes"] > 0  # at least the global down and the sum up
        assert 0.0 <= r["traffic_s"] <= r["train"]
    assert result["run_over_ideal"] == pytest.approx(sum(r["round"] for r in result["per_round"]) /
                                                     sum(r["ideal_s"] for r in result["per_round"]))
    table = ideal["phases"]
    assert sum(row["actual_s"] for row in table.values()) == pytest.approx(ideal["rounds_s"])
    parts = result["setup_parts_s"]
    assert parts["actor_model_load"] > 0 and parts["actor_imports"] > 0 and parts["actor_client_state"] >= 0
    path = write(result, str(tmp_path / "out"))
    written = json.loads(path.read_text())
    assert path.name == "run_smoke_k4.json" and {k: v for k, v in written.items() if k != "provenance"} == \
        json.loads(json.dumps(result))
    assert {"commit", "device", "torch", "transformers"} <= set(written["provenance"])


def test_a_rounds_phases_partition_its_seconds_and_name_the_busiest_actors_parts():
    """``actors.round_phases`` by hand: two actors, the busier one's preparation, upload and training are the
    round's; the training call's wall time beyond it is traffic; own work is preparation, upload,
    aggregation and the final update; every phase with the rest makes up the round."""
    from types import SimpleNamespace

    from fedsweep.actors.round_phases import phases

    def result(train, prepare=0.0, upload=0.0, host=0.0, scored=0.0):
        return SimpleNamespace(metrics={"train_seconds": train, "prepare_seconds": prepare, "upload_seconds": upload,
                                        "prepare_host_seconds": host, "method_scored_tokens": scored})

    results = {0: result(1.0, 0.4, 0.1, 0.3, 100.0), 1: result(1.0, 0.4, 0.1, 0.3, 100.0), 2: result(1.5)}
    seconds = {"train_seconds": 2.5, "aggregation_seconds": 0.2, "eval_seconds": 0.5, "checkpoint_seconds": 0.1,
               "final_update_seconds": 0.7}
    out = phases(seconds, results, {0: 0, 1: 0, 2: 1}, round_s=3.5)
    assert out["phase/train_s"] == pytest.approx(2.0 - 0.8 - 0.2) and out["phase/prepare_s"] == pytest.approx(0.8)
    assert out["phase/upload_s"] == pytest.approx(0.2) and out["phase/prepare_host_s"] == pytest.approx(0.6)
    assert out["phase/traffic_s"] == pytest.approx(0.5) and out["phase/final_update_s"] == 0.7
    assert out["phase/own_work_s"] == pytest.approx(0.8 + 0.2 + 0.2 + 0.7)
    assert out["work/scored_tokens"] == 200.0
    parts = ("train", "prepare", "upload", "traffic", "aggregate", "eval", "checkpoint", "rest")
    assert sum(out[f"phase/{p}_s"] for p in parts) == pytest.approx(3.5)


def test_a_planted_delay_raises_the_run_over_its_ideal_by_its_share(ray_session, tmp_path, monkeypatch):
    """Two rounds through the real server in-process (``test_lockstep``'s), then again with every round's
    checkpoint write held 0.25 s longer: at the same rates the ideal stays, the delay lands whole in the
    checkpoint phase's seconds, and the run over its ideal is the rounds' own wall seconds over it, so the
    delay's share is in it. The two runs' wholes are not compared: on two busy cores the other phases move
    between runs by half the delay (CI, stop 96: 0.36 s of 0.5 s showed)."""
    from fedsweep.actors.fleet import ClientFleet
    from fedsweep.bench.ideal import ideal_rounds
    from fedsweep.bench.run import round_breakdown

    from test_lockstep import BASE, _merge, two_rounds

    raw = _merge(BASE, {"checkpoint": {"enabled": True, "overlap": False}})
    cfg = __import__("fedsweep.config", fromlist=["validate"]).validate(raw)
    rates = {"train_tokens_per_s": 2000.0, "forward_tokens_per_s": 20000.0, "generate_tokens_per_s": 500.0}

    def run(folder) -> tuple[dict, float]:
        _, reports = two_rounds(raw, folder)
        rounds = [round_breakdown(r) for r in reports]
        return ideal_rounds(cfg, rounds, measured=rates), sum(r["round"] + r["final_update"] for r in rounds)

    plain, plain_s = run(tmp_path / "plain")
    original = ClientFleet.checkpoint  # (inside the span the server times as the round's checkpoint)
    monkeypatch.setattr(ClientFleet, "checkpoint", lambda self, rnd, state: (time.sleep(0.25),
                                                                            original(self, rnd, state))[1])
    delayed, delayed_s = run(tmp_path / "delayed")
    ideal = plain["ideal_s"]
    assert delayed["ideal_s"] == pytest.approx(ideal, abs=0.01)  # the same work (and aggregation, as measured)
    held = delayed["phases"]["checkpoint"]["actual_s"]
    assert 2 * 0.25 <= held < 2 * 0.25 + 0.5, held  # the delay is the checkpoint's, whole (and not twice)
    for out, whole in ((plain, plain_s), (delayed, delayed_s)):  # over the rounds' own wall seconds, so the
        assert out["run_over_ideal"] == pytest.approx(whole / ideal, rel=1e-3)  # delay is in the numerator
