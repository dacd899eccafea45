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
    assert all(v > 0 for v in ideal["rates"].values()) and ideal["evaluation"]["test_tokens"] > 0
    for r in result["per_round"]:
        want = r["train_tokens"] / ideal["rates"]["train_tokens_per_s"]
        if r["evaluated"]:
            want += ideal["evaluation"]["test_tokens"] / ideal["rates"]["forward_tokens_per_s"] + \
                ideal["evaluation"]["prompts"] * 8 / ideal["rates"]["generate_tokens_per_s"]
        assert r["ideal_s"] == pytest.approx(want) and r["over_ideal"] == pytest.approx(r["round"] / want)
        assert r["traffic_bytes"] >= 2 * result["adapter_bytes"] > 0  # at least the global down and the sum up
        assert 0.0 <= r["traffic_s"] <= r["train"]
    assert result["run_over_ideal"] == pytest.approx(sum(r["round"] for r in result["per_round"]) /
                                                     sum(r["ideal_s"] for r in result["per_round"]))
    parts = result["setup_parts_s"]
    assert parts["actor_model_load"] > 0 and parts["actor_imports"] > 0 and parts["actor_client_state"] >= 0
    path = write(result, str(tmp_path / "out"))
    written = json.loads(path.read_text())
    assert path.name == "run_smoke_k4.json" and {k: v for k, v in written.items() if k != "provenance"} == \
        json.loads(json.dumps(result))
    assert {"commit", "device", "torch", "transformers"} <= set(written["provenance"])
