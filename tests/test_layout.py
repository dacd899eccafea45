"""The automatic actor layout against hand-computed layouts, and refusals in one line."""

from __future__ import annotations

import pytest

from fedsweep.config import validate
from fedsweep.plan.layout import Cluster, actors_for, choose
from fedsweep.errors import ConfigError
from fedsweep.plan.resolve import host_bytes, resolve_layout

GiB = 2 ** 30


def _choose(k, cluster, per="auto", actors="auto", cpus=1.0, gpus=0.0, models=None, host=None, gpu=None, work=None):
    return choose(k, models or ["m"] * k, per, actors, cpus, gpus, cluster, host, gpu, work_s=work)


@pytest.mark.parametrize("k,cpus,expected", [
    (4, 2.9, (2, 2)),      # this machine: 2 cores + 1 coordination CPU, less the server's 0.1
    (10, 2.9, (2, 5)),
    (20, 2.9, (2, 10)),
    (50, 2.9, (2, 25)),
    (3, 15.9, (3, 1)),     # never more actors than clients
    (50, 15.9, (13, 4)),   # 15 slots: the smallest p with ⌈50/p⌉ ≤ 15 is 4 → 13 actors
    (1, 0.5, None),        # not even one 1-CPU actor fits
])
def test_cpu_layout_is_one_actor_per_slot(k, cpus, expected):
    if expected is None:
        with pytest.raises(ConfigError, match="no layout of 1 clients fits"):
            _choose(k, Cluster(cpus=cpus))
        return
    got = _choose(k, Cluster(cpus=cpus))
    assert (got.num_actors, got.clients_per_actor) == expected
    # brute force: the most actors that fit, then the fewest clients per actor
    best = max((actors_for([k], p), -p) for p in range(1, k + 1) if actors_for([k], p) <= int(cpus))
    assert (got.num_actors, got.clients_per_actor) == (best[0], -best[1])


@pytest.mark.parametrize("gpus,share,k,expected", [
    (8, 1.0, 50, (8, 7)),       # one actor per GPU, 50 clients packed ⌈50/8⌉ = 7 to an actor
    (8, 0.5, 50, (13, 4)),      # per half GPU: 16 slots, but only 16 CPUs less the server's: 15 → 13 × 4
    (1, 0.25, 10, (4, 3)),      # four quarter-GPU slots on one GPU
    (2, 1.0, 1, (1, 1)),
])
def test_gpu_layout_is_one_actor_per_gpu_share(gpus, share, k, expected):
    got = _choose(k, Cluster(cpus=15.9, gpus=gpus), gpus=share)
    assert (got.num_actors, got.clients_per_actor) == expected


def test_gpu_memory_caps_clients_per_actor():
    # the planner says 10 GiB + 3 GiB per client; a 40 GiB GPU takes 10 GiB + 10 × 3 = 40 → at most 10
    gpu = lambda p: (10 + 3 * p) * GiB  # noqa: E731
    with pytest.raises(ConfigError) as info:
        _choose(50, Cluster(cpus=63.9, gpus=4, gpu_memory=40 * GiB), gpus=1, gpu=gpu)
    msg = str(info.value)
    assert "\n" not in msg and "GPU memory" in msg
    got = _choose(40, Cluster(cpus=63.9, gpus=4, gpu_memory=40 * GiB), gpus=1, gpu=gpu)
    assert (got.num_actors, got.clients_per_actor) == (4, 10)


def test_host_memory_limits_the_number_of_actors():
    # 1 GiB per actor process + 0.1 GiB per client; 6 GiB of host memory, 16 CPU slots, 20 clients:
    # A(p) · (1 + 0.1 p) ≤ 6 → p = 4 gives 5 actors · 1.4 = 7 (no); p = 5: 4 · 1.5 = 6 (yes)
    host = lambda p: (1 + 0.1 * p) * GiB  # noqa: E731
    got = _choose(20, Cluster(cpus=16, memory=6 * GiB), host=host)
    assert (got.num_actors, got.clients_per_actor) == (4, 5)


def test_explicit_numbers_win_and_are_checked():
    got = _choose(10, Cluster(cpus=2.9), per=5)
    assert (got.num_actors, got.clients_per_actor) == (2, 5) and "as set" in got.reason
    got = _choose(10, Cluster(cpus=2.9), actors=2)
    assert (got.num_actors, got.clients_per_actor) == (2, 5)
    with pytest.raises(ConfigError) as info:
        _choose(50, Cluster(cpus=2.9, memory=16 * GiB), per=1, host=lambda p: 0.6 * GiB)
    msg = str(info.value)
    assert "\n" not in msg and "50 actor(s)" in msg and "clients.clients_per_actor=25" in msg


def test_mixed_models_get_actors_of_their_own():
    models = ["a"] * 3 + ["b"] * 2
    got = _choose(5, Cluster(cpus=2.9), models=models)
    assert (got.num_actors, got.clients_per_actor) == (2, 3)  # one actor per base model at least
    got = _choose(5, Cluster(cpus=8), models=models)
    assert (got.num_actors, got.clients_per_actor) == (5, 1)
    with pytest.raises(ConfigError, match="2 base models"):
        _choose(5, Cluster(cpus=8), actors=1, models=models)


def test_layout_disagreement_is_a_config_error():
    with pytest.raises(ConfigError, match="disagree"):
        validate({"name": "x", "clients": {"num_clients": 10, "clients_per_actor": 3, "num_actors": 2}})


def test_resolved_config_carries_the_layout_and_actor_groups():
    cfg = validate({"name": "x", "rounds": 50, "clients": {"num_clients": 5}})  # training enough for 2 actors
    with pytest.raises(RuntimeError, match="auto"):
        cfg.actor_groups()
    resolved, layout = resolve_layout(cfg, Cluster(cpus=2.9, memory=16 * GiB))
    assert resolved.clients.clients_per_actor == 3 and resolved.clients.num_actors == 2
    assert resolved.actor_groups() == [[0, 1, 2], [3, 4]] and layout.num_actors == 2
    assert cfg.clients.clients_per_actor == "auto"  # the original is untouched


def _t(n, work, cores):
    """t(n) written out: the start of n actors (5.5 CPU-s each, 8 CPU-s of the rest) on the cores,
    never less than one actor's start, then the work split over n actors."""
    return max(5.5, (5.5 * n + 8.0) / cores) + work / n


@pytest.mark.parametrize("k,work,cores,cpus,expected", [
    (4, 0.96, 2, 2.9, (1, 4)),     # t(1) = 6.75 + 0.96 = 7.71 < t(2) = 9.5 + 0.48 = 9.98
    (20, 3.21, 2, 2.9, (1, 20)),   # 9.96 < 11.11
    (50, 8.04, 2, 2.9, (2, 25)),   # 14.79 > 13.52: training repays the second actor
    (50, 0.0, 2, 2.9, (1, 50)),    # nothing to train: one actor
    (50, 6.0, 16, 15.9, (13, 4)),  # many cores: t(n) = 5.5 + 6/n falls up to the 13 actors that fit
    (20, 3.0, 4, 7.9, (2, 10)),    # 7 slots, 4 cores: t(1) = 8.5, t(2) = 7.0, t(3) = 7.125, t(4) = 8.25
])
def test_short_cpu_runs_get_fewer_actors(k, work, cores, cpus, expected):
    got = _choose(k, Cluster(cpus=cpus, cores=cores), work=work)
    # brute force over every packing that fits the slots: the fewest estimated seconds, then the most actors
    feasible = [p for p in range(1, k + 1) if actors_for([k], p) <= int(cpus)]
    best = min(feasible, key=lambda p: (round(_t(actors_for([k], p), work, cores), 9), p))
    assert (got.num_actors, got.clients_per_actor) == (actors_for([k], best), best)
    assert (got.num_actors, got.clients_per_actor) == expected
    if got.num_actors < actors_for([k], min(feasible)):
        assert "does not repay" in got.reason


def test_work_leaves_gpu_and_explicit_layouts_alone():
    got = _choose(50, Cluster(cpus=15.9, gpus=8), gpus=1.0, work=0.0)
    assert (got.num_actors, got.clients_per_actor) == (8, 7)
    got = _choose(10, Cluster(cpus=2.9, cores=2), actors=2, work=0.0)
    assert (got.num_actors, got.clients_per_actor) == (2, 5)


def test_training_seconds_from_shapes_by_hand():
    from fedsweep.plan.resolve import training_seconds

    cfg = validate({"name": "x", "rounds": 3, "model": {"name": "tiny", "tiny": {
        "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 128}},
        "clients": {"num_clients": 10, "fraction": 0.35}, "train": {"steps": 5, "batch_size": 8, "max_length": 64}})
    # 259×64 tied embeddings; per layer q,k,v,o 4·64² + gate,up,down 3·64·128 + 2 norms of 64; a final norm
    params = 259 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    step = 0.01 + 6 * params * 8 * 64 / 5e10
    assert training_seconds(cfg) == pytest.approx(3 * 4 * 5 * step)  # ⌈0.35 · 10⌉ = 4 clients a round
    epochs = validate({"name": "x", "train": {"epochs": 1}})
    assert training_seconds(epochs) is None  # steps depend on the data


def test_host_footprint_counts_processes_weights_and_clients():
    cfg = validate({"name": "x", "model": {"name": "smollm2-135m-instruct"}, "lora": {"r": 8},
                    "train": {"batch_size": 4, "max_length": 64}})
    est = host_bytes(cfg)
    one, two = est(1), est(2)
    # q and v (the default targets) of 30 layers: A 8×576 each; B 576×8 for q, 192×8 for v (3 KV heads of 64)
    adapter = 30 * (8 * 576 + 576 * 8 + 8 * 576 + 192 * 8)
    assert two - one == pytest.approx(adapter * (4 + 8))  # float32 params + AdamW's two moments
    assert one > 134_515_008 * 4  # the fp32 base alone


def test_a_layout_that_does_not_fit_the_running_cluster_is_refused_in_one_line(ray_session):
    """Fifty 1-client actors of ~0.6 GiB each against the host memory Ray offers here: refused before
    any actor starts, naming the layout that fits."""
    from fedsweep.orchestrator.runtime.placement import cluster_view

    cfg = validate({"name": "x", "clients": {"num_clients": 50, "clients_per_actor": 1, "resources": {"num_cpus": 0.01}}})
    with pytest.raises(ConfigError) as info:
        resolve_layout(cfg, cluster_view(cfg))
    msg = str(info.value)
    assert "\n" not in msg and "host memory" in msg and "clients.clients_per_actor=" in msg
    auto = validate({"name": "x", "clients": {"num_clients": 50, "resources": {"num_cpus": 0.01}}})
    resolved, layout = resolve_layout(auto, cluster_view(auto))
    assert layout.num_actors * host_bytes(auto)(layout.clients_per_actor) <= cluster_view(auto).memory


def test_a_run_refuses_a_set_layout_that_does_not_fit_before_any_actor_starts(ray_session, tmp_path):
    from fedsweep.orchestrator.runner import Experiment

    cfg = validate({"name": "x", "data": {"examples_per_task": 40}, "checkpoint": {"dir": str(tmp_path)},
                    "tracking": {"enabled": False},
                    "clients": {"num_clients": 50, "clients_per_actor": 1, "resources": {"num_cpus": 0.01}}})
    experiment = Experiment(cfg)
    try:
        with pytest.raises(ConfigError, match="does not fit"):
            experiment.setup()
        assert experiment.actors == [] and experiment.server is None and experiment.pg is None
    finally:
        experiment.teardown("FAILED")


def test_the_cores_are_known_only_in_a_runtime_fedsweep_started(monkeypatch):
    """The driver and a study's trials (Ray workers, which inherit the mark) see the same cores from the
    same snapshot; a cluster (or a runtime someone else started) counts its logical CPUs instead."""
    import os

    from fedsweep.env import LOCAL_RUNTIME_ENV
    from fedsweep.orchestrator.runtime.placement import cluster_view

    cfg = validate({"name": "x"})
    free = {"CPU": 3.0, "memory": 8.0 * GiB}
    monkeypatch.setenv(LOCAL_RUNTIME_ENV, "1")
    assert cluster_view(cfg, free, share=0.5).cores == (os.cpu_count() or 1) * 0.5
    monkeypatch.delenv(LOCAL_RUNTIME_ENV)
    view = cluster_view(cfg, free)
    assert view.cores is None and view.cpus == pytest.approx(3.0 - cfg.server.resources.num_cpus)
