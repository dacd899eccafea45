"""``fedsweep bench run CONFIG``: one experiment, end to end, timed phase by phase.

What a user waits for, from the process's start to the end of tear-down: the driver's imports,
config validation, Ray's start, data and the tracking run (made while Ray starts, so they overlap
it), the layout, the placement group, the actors' start, then every round split into training,
aggregation, evaluation, checkpoint and the rest (orchestration: the round minus the busiest
actor's training, minus aggregation, evaluation and checkpoint), and tear-down; plus the peak
resident memory of the whole process tree (driver, Ray's processes, actors), sampled every 0.2 s.
Written as JSON under ``results/bench/`` (``run_<name>_k<K>.json``).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from fedsweep.actors.round_phases import PHASES
from fedsweep.process_start import process_start_epoch

ROUND_PARTS = ("train_seconds", "aggregation_seconds", "eval_seconds", "checkpoint_seconds")


class TreeRSS:
    """Peaks of the summed memory of this process and all its descendants, sampled in a thread: RSS
    (``peak``; pages shared between processes count once per process, as the Flower harness counts
    them) and PSS (``peak_pss``; a shared page split between the processes that map it, so the sum is
    what the tree holds: forked workers share their parent's imported libraries until they write to
    them). PSS is 0 where the system does not report it (Linux does).

    RSS is read every ``interval`` (0.02 ms a process); PSS every ``pss_every``-th time only, since the
    kernel walks a process's every mapping to compute it: 4-7 ms a process with torch loaded, so a tree
    of ten read every 0.2 s cost the driver 2.4 CPU-seconds in a 17.6 s run (72 samples, 33 ms each),
    taken from the run it measures on 2 cores. ``cpu_s``: the CPU time the sampling itself took, which the
    JSON reports (``sampler_cpu_s``) beside what it measured."""

    def __init__(self, interval: float = 0.2, pss_every: int = 5):
        self.interval = interval
        self.pss_every = pss_every
        self.peak = 0
        self.peak_pss = 0
        self._ticks = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fedsweep-rss", daemon=True)

    def sample(self, pss: bool = True) -> int:
        """Read the tree's RSS (and its PSS where ``pss``) and keep the peaks; the RSS sum."""
        started = time.thread_time()
        me = psutil.Process()
        total = pss_total = 0
        for p in [me] + me.children(recursive=True):
            try:
                total += p.memory_info().rss
                pss_total += process_pss(p) if pss else 0
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)
        self.peak_pss = max(self.peak_pss, pss_total)
        self.cpu_s += time.thread_time() - started
        return total

    def peaks_mib(self) -> dict[str, float]:
        """The peaks as a bench JSON carries them, with the sampling's own CPU time."""
        return {"peak_rss_tree_mib": round(self.peak / 2 ** 20, 1), "peak_pss_tree_mib": round(self.peak_pss / 2 ** 20, 1),
                "sampler_cpu_s": round(self.cpu_s, 3)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._ticks += 1
            self.sample(pss=self._ticks % self.pss_every == 0)

    def __enter__(self) -> "TreeRSS":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def process_pss(process: psutil.Process) -> int:
    """A process's proportional set size in bytes: Linux's ``smaps_rollup`` (one summary line, where
    psutil's ``memory_full_info`` also reads the rest), else psutil's answer, 0 where there is none."""
    try:
        with open(f"/proc/{process.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return int(getattr(process.memory_full_info(), "pss", 0))


def round_breakdown(summary: dict[str, Any]) -> dict[str, float]:
    """One round's seconds by part; ``overhead`` is what no actor and no method computed; ``phases`` its
    seconds by phase (``actors.round_phases``) and the work the ideal reads (``bench.ideal``)."""
    m = summary["metrics"]
    parts = {k.removesuffix("_seconds"): float(m.get(k, 0.0)) for k in ROUND_PARTS}
    busiest = float(m.get("busiest_actor_train_seconds", parts["train"]))
    parts["busiest_actor_train"] = busiest
    parts["round"] = float(m["round_seconds"])
    parts["overhead"] = parts["round"] - busiest - parts["aggregation"] - parts["eval"] - parts["checkpoint"]
    parts["overhead_share_without_eval"] = parts["overhead"] / max(parts["round"] - parts["eval"], 1e-9)
    # the per-round target's own terms: everything but the busiest actor's training (checkpoint and
    # aggregation included), evaluation left out
    parts["beyond_training"] = parts["round"] - busiest - parts["eval"]
    parts["beyond_training_share"] = parts["beyond_training"] / max(parts["round"] - parts["eval"], 1e-9)
    parts["checkpoint_deferred"] = bool(m.get("checkpoint_deferred", 0.0))
    parts["evaluated"] = bool(summary["evaluated"])
    # the server <-> actors traffic: tensor bytes both ways, and training's time beyond the busiest actor's
    parts["traffic_bytes"] = float(m.get("traffic_bytes", 0.0))
    parts["traffic_s"] = float(m.get("traffic_seconds", 0.0))
    parts["final_update"] = float(m.get("final_update_seconds", 0.0))  # (its own phase, not in the round)
    parts["work"] = {k.removeprefix("work/"): float(v) for k, v in m.items() if k.startswith("work/")}
    parts["train_tokens"] = parts["work"].get("train_tokens", 0.0)
    parts["prepare_host"] = float(m.get("phase/prepare_host_s", 0.0))
    parts["phases"] = {p: float(m.get(f"phase/{p}_s", 0.0)) for p in PHASES}
    return parts


def study_cell(sweep_path: str, variant: str, seed: int | None, folder: str) -> str:
    """One cell of a study (``fedsweep tune``'s trial of ``variant`` on ``seed``, the study's first where
    None; each swept dimension at its first value) as the experiment file the study runs, written
    into ``folder``; its path. Refused in one line where the study has no such variant."""
    import yaml

    from fedsweep.config.sweep import absolute_paths, load_sweep, trial_raw
    from fedsweep.errors import ConfigError

    sweep, base = load_sweep(sweep_path)
    variants = list(sweep.variants or {})
    if variants and variant not in variants:
        raise ConfigError(f"--variant {variant!r}: {sweep_path} has the variants {', '.join(variants)}")
    params = {"variant": variant, "seed": sweep.seeds[0] if seed is None else seed,
              **{k: d.examples()[0] for k, d in sweep.space.items()}}
    raw = absolute_paths(trial_raw(base, sweep, params))
    raw["name"] = f"{sweep.name}-{variant}"
    path = Path(folder) / f"{raw['name']}-seed{params['seed']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def bench_run(config: str, overrides: list[str], started: float | None = None, ideal: bool = True) -> dict[str, Any]:
    """Run ``config`` and return the phase breakdown (``started``: the process's start, epoch seconds;
    ``ideal``: measure the rounds' ideal after the tear-down, else leave it to :func:`measure_ideal` in
    a process of its own)."""
    t_enter = time.time()
    started = started if started is not None else process_start_epoch()
    with TreeRSS() as rss:
        t0 = time.perf_counter()
        from fedsweep.orchestrator import preflight
        from fedsweep.orchestrator.runtime import ray_runtime

        cfg = ray_runtime.start_while(preflight.load_experiment, config, overrides)  # as ``fedsweep run`` does
        from fedsweep.orchestrator.runner import Experiment

        t_config = time.perf_counter() - t0
        experiment = Experiment(cfg)
        status = "FAILED"
        actor_starts, frozen, forks = [], [], {}
        try:
            with experiment.phase("setup"):
                t_setup = time.time()
                experiment.setup()
            actor_starts, frozen = _actor_starts(experiment, t_setup)
            forks = _worker_forks(started, t_setup)
            with experiment.phase("rounds"):
                outcome = experiment.run_rounds()
            status = "FINISHED"
        finally:
            experiment.teardown(status)
        t_end = time.time()
    cfg = experiment.cfg
    rounds = [round_breakdown(s) for s in outcome.rounds]
    if ideal:
        from fedsweep.bench.ideal import ideal_rounds

        ideal = ideal_rounds(cfg, rounds)
    else:
        ideal = {"run_over_ideal": None, "note": "not measured in this process: fedsweep bench run --ideal-of JSON"}
    return _result(config, overrides, cfg, experiment, outcome, rounds, ideal, rss, started, t_enter, t_config,
                   t_end, actor_starts, frozen, forks)


def _result(config, overrides, cfg, experiment, outcome, rounds, ideal, rss, started, t_enter, t_config, t_end,
            actor_starts, frozen, forks) -> dict[str, Any]:
    """:func:`bench_run`'s JSON."""
    unevaluated = [r for r in rounds if not r["evaluated"]]
    phases = dict(experiment.phases)
    return {
        "benchmark": "run", "config": config, "overrides": overrides, "name": cfg.name,
        "algorithm": cfg.algorithm, "model": cfg.model.name, "clients": cfg.clients.num_clients, "seed": cfg.seed,
        "rounds": cfg.rounds, "num_actors": cfg.num_actors, "clients_per_actor": cfg.clients.clients_per_actor,
        "layout": experiment.layout.describe() if experiment.layout else "as set in the config",
        "tracking": cfg.tracking.enabled, "checkpoints": cfg.checkpoint.enabled,
        "total_wall_s": t_end - started,
        "total_wall_note": "process start -> tear-down done (Ray stopped, tracking run ended); the Flower "
                           "harness's total ends when run_simulation returns",
        "phases_s": {
            "driver_imports": t_enter - started,
            "config_and_ray_start": t_config,
            **{k: phases[k] for k in ("ray_init", "data", "models", "memory_plan", "tracking", "layout",
                                                 "placement_group", "actors", "tracking_wait")
               if k in phases},
            "setup": phases.get("setup", 0.0),
            "rounds": phases.get("rounds", 0.0),
            "teardown": phases.get("teardown", 0.0),
        },
        "phases_note": "Ray starts while the config is validated in a thread (config_and_ray_start: both done; "
                       "ray_init: a restart where the config asked more CPUs); data, models and memory_plan run "
                       "in a thread during ray_init, the tracking run in another until the actors are up "
                       "(tracking_wait: what was left to wait for then)",
        "client_actor_starts_s": actor_starts,
        "client_actor_starts_note": "per client actor, seconds after setup began: its process started, its "
                                    "imports were done, its construction (model, data) began and ended",
        "client_actor_frozen_objects": frozen,  # built without cyclic collections, then frozen (actors/heap.py)
        "per_round": rounds,
        "overhead_share_without_eval_median": (statistics.median(r["overhead_share_without_eval"] for r in unevaluated)
                                               if unevaluated else None),
        "beyond_training_share_median": (statistics.median(r["beyond_training_share"] for r in unevaluated)
                                         if unevaluated else None),
        "per_round_note": "overhead: round - busiest actor's training - aggregation - evaluation - checkpoint; "
                          "beyond_training: round - busiest actor's training - evaluation (the per-round target's "
                          "terms); checkpoint_deferred: that round's files were written while the next round trained",
        "adapter_bytes": max((s["metrics"].get("adapter_bytes", 0.0) for s in outcome.rounds), default=0.0),
        "ideal": ideal,
        "run_over_ideal": ideal["run_over_ideal"],
        "resolved_config": cfg.to_dict(),  # (what --ideal-of measures the ideal of)
        "setup_parts_s": _setup_parts(actor_starts, phases),
        "setup_s": t_enter - started + t_config + phases.get("setup", 0.0),  # process start -> round 1 can begin
        "worker_forks": forks,
        **rss.peaks_mib(),
        "final_train_loss": outcome.rounds[-1]["metrics"].get("train_loss") if outcome.rounds else None,
        "cpu_count": os.cpu_count(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _setup_parts(starts: list[dict[str, float]], phases: dict[str, float]) -> dict[str, float]:
    """The set-up by part: the driver's data and layout, and the slowest client actor's imports, model
    load and clients' state (from its start times, relative to set-up's begin)."""
    out = {"data": phases.get("data", 0.0), "layout": phases.get("layout", 0.0), "ray_init": phases.get("ray_init", 0.0)}
    if starts:
        last = max(starts, key=lambda t: t.get("init_end", 0.0))
        out["actor_imports"] = last.get("module_ready", 0.0) - last.get("process_start", 0.0)
        out["actor_model_load"] = last.get("base_built", last.get("init_end", 0.0)) - last.get("init_start", 0.0)
        out["actor_client_state"] = last.get("init_end", 0.0) - last.get("base_built", last.get("init_end", 0.0))
    return {k: round(v, 3) for k, v in out.items()}


def _worker_forks(started: float, t_setup: float) -> dict[str, Any]:
    """Whether Ray's workers were forked from the fork server (orchestrator/runtime/fork_server.py): the
    processes it forked (by their titles, once the actors are up), when it started (seconds after this
    process), and when its imports were done, in seconds after the process started and after set-up began."""
    from fedsweep.orchestrator.runtime import fork_server

    ready, pid = fork_server.ready_at(), fork_server.server_pid()
    forked = []
    if pid is not None:
        try:
            forked = sorted(" ".join(p.cmdline()[:1]) for p in psutil.Process(pid).children())
        except psutil.Error:
            pass
    born = process_start_epoch(pid) if pid is not None else None
    return {"on": ready is not None, "forked": forked,
            "server_started_after_process_start_s": round(born - started, 3) if born else None,
            "server_ready_after_process_start_s": round(ready - started, 3) if ready else None,
            "server_ready_after_setup_began_s": round(ready - t_setup, 3) if ready else None}


def _actor_starts(experiment, t0: float) -> tuple[list[dict[str, float]], list[int]]:
    """Per client actor: its start times relative to ``t0``, and the objects its construction froze."""
    import ray

    times = ray.get([a.start_times.remote() for a in experiment.actors], timeout=60)
    frozen = ray.get([a.frozen_objects.remote() for a in experiment.actors], timeout=60)
    return [{k: round(v - t0, 3) for k, v in t.items()} for t in times], frozen


def measure_ideal(result: dict[str, Any]) -> dict[str, Any]:
    """A ``bench run`` result measured with ``ideal=False``, its ideal measured now (``--ideal-of``: in a
    process of its own, so that the run's figures and the ideal's come from separate steps with
    separate time limits); the result with ``ideal`` and ``run_over_ideal`` filled."""
    from fedsweep.bench.ideal import ideal_rounds
    from fedsweep.config import validate
    from fedsweep.errors import ConfigError

    if "resolved_config" not in result:
        raise ConfigError("--ideal-of: the JSON has no resolved_config (a bench run from before 2026-12-07)")
    cfg = validate(result["resolved_config"])
    ideal = ideal_rounds(cfg, result["per_round"])
    return {**result, "ideal": ideal, "run_over_ideal": ideal["run_over_ideal"], "ideal_measured_apart": True}


def write(result: dict[str, Any], out: str) -> Path:
    """``out``: a folder (the file is named ``run_<name>_k<K>.json``) or a ``.json`` path."""
    path = Path(out)
    if path.suffix != ".json":
        path = path / f"run_{result['name']}_k{result['clients']}.json"
    from fedsweep.bench.record import write_json

    return write_json(result, path)
