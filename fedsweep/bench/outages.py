"""The faults that take a process outside the run down, for ``fedsweep bench faults --kinds``: a driver
killed between a round's commit and its metrics (``commit``) or inside its set-up, once its MLflow run
exists and before any round (``setup``), the tracking server mid-run (``tracking``), away when the run
starts (``tracking-start``) or while a study's trials start and end (``study-tracking``), a study's
driver (``study``) and a worker node (``node``). Each runs the real thing — a ``fedsweep``
command in a process of its own, SIGKILLed; a real ``mlflow server`` on a loopback port; a two-node
local Ray cluster — beside the same work undisturbed, and says what recovered, what it cost and
whether the result is the undisturbed one (bit for bit for a run's final checkpoint, equal final
test losses for a study), and whether every round's metrics were logged exactly once.

The processes are found and ended by PID (a local run's watchdog ends its Ray processes when its
driver dies); servers listen on loopback only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml

OUTAGE_KINDS = ("commit", "tracking", "study", "node", "node-no-room", "setup", "tracking-start", "study-tracking")


# ------------------------------------------------------------------------------ harness
def command(*args: str, cwd: Path | None = None) -> subprocess.Popen:
    """``fedsweep ARGS`` in a process of its own (its own session: a SIGKILL of it is a crash)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "fedsweep.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def committed(runs: Path, rnd: int) -> list[Path]:
    """Run folders below ``runs`` whose round ``rnd`` is committed (the folder that holds ``checkpoints/``)."""
    return [p.parents[2] for p in Path(runs).glob(f"**/checkpoints/round_{rnd:04d}/COMPLETE")]


def kill_at_commit(proc: subprocess.Popen, runs: Path, rnd: int, timeout: float = 900.0) -> float | None:
    """SIGKILL ``proc`` (the driver alone) as soon as a run below ``runs`` commits round ``rnd``; when."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if committed(runs, rnd):
            os.kill(proc.pid, signal.SIGKILL)
            return time.monotonic()
        time.sleep(0.02)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_server(port: int, where: Path, timeout: float = 300.0) -> subprocess.Popen:
    """A real tracking server on ``127.0.0.1:port`` (its sqlite store and artifacts under ``where``), up."""
    mlflow = Path(sys.executable).parent / "mlflow"
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", f"sqlite:///{where / 'server.db'}",
                             "--artifacts-destination", str(where / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], cwd=where, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"the tracking server on port {port} did not come up within {timeout:g} s")


def stop(proc: subprocess.Popen | None) -> None:
    """End a process started here and its session (SIGKILL), and reap it."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)


def logged_once(uri: str, experiment: str, key: str = "train_loss") -> dict[str, Any]:
    """Each run of ``experiment``: its status and the steps at which ``key`` was logged."""
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return {r.info.run_id: {"status": r.info.status,
                            "steps": sorted(m.step for m in client.get_metric_history(r.info.run_id, key))}
            for r in runs}


def record_gaps(run_dir: Path) -> list[float]:
    """Seconds between consecutive rounds' records (each stamped by the server as its round ends)."""
    from fedsweep import checkpoint as ckpt

    stamps, rnd = [], 1
    while (record := ckpt.read_record(Path(run_dir) / "checkpoints", rnd)) is not None:
        stamps.append(record["logged_at"] / 1000)
        rnd += 1
    return [b - a for a, b in zip(stamps, stamps[1:])]


# ------------------------------------------------------------------------------ scenarios
def _config_file(cfg, folder: Path, uri: str) -> Path:
    raw = cfg.to_dict()
    raw["checkpoint"] = {**raw["checkpoint"], "enabled": True, "dir": str(folder / "runs")}
    raw["tracking"] = {**raw["tracking"], "enabled": True, "uri": uri, "experiment": folder.name, "wait_s": 1800}
    path = folder / "config.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _verdict(run_dir: Path, calm_dir: Path, runs: dict[str, Any], rounds: int) -> dict[str, Any]:
    from fedsweep.bench.recovery import bitwise_equal, final_state

    a, b = final_state(calm_dir), final_state(run_dir)
    differing = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not bitwise_equal(a[k], b[k]))
    (only,) = runs.values() if len(runs) == 1 else (None,)
    return {"bitwise_equal": not differing, "differing": differing[:10], "mlflow_runs": len(runs),
            "status": only["status"] if only else [r["status"] for r in runs.values()],
            "metrics_once": bool(only) and only["steps"] == list(range(1, rounds + 1))}


def commit_kill(cfg, scratch: Path, rnd: int, calm_dir: Path, calm_s: float, say: Callable[[str], None]) -> dict:
    """The driver SIGKILLed as soon as round ``rnd`` commits (its metrics not yet logged), then
    ``fedsweep run --resume``."""
    folder = scratch / "commit"
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    cfg_file = _config_file(cfg, folder, uri)
    t0 = time.monotonic()
    proc = command("run", str(cfg_file), "--quiet")
    killed = kill_at_commit(proc, folder / "runs", rnd)
    proc.communicate(timeout=120)
    if killed is None:
        return {"kind": "commit", "round": rnd, "landed": "not fired (the run ended first)"}
    say(f"commit: driver killed as round {rnd} committed; resuming")
    time.sleep(3)
    again = command("run", str(cfg_file), "--quiet", "--resume")
    out = again.communicate(timeout=3600)[0]
    total = time.monotonic() - t0
    run_dir = committed(folder / "runs", cfg.rounds)[0]
    return {"kind": "commit", "round": rnd, "landed": f"after round {rnd}'s commit", "exit": again.returncode,
            "tail": out.strip().splitlines()[-1:], "cost_s": round(total - calm_s, 2),
            **_verdict(run_dir, calm_dir, logged_once(uri, folder.name), cfg.rounds)}


def tracking_outage(cfg, scratch: Path, rnd: int, away_s: float, calm_dir: Path, calm_s: float,
                    say: Callable[[str], None]) -> dict:
    """A real ``mlflow server`` SIGKILLed as soon as round ``rnd`` commits, back ``away_s`` later."""
    folder = scratch / "tracking"
    port = free_port()
    server = mlflow_server(port, folder / "server")
    uri = f"http://127.0.0.1:{port}"
    cfg_file = _config_file(cfg, folder, uri)
    back: dict[str, Any] = {}

    def restart() -> None:
        time.sleep(away_s)
        back["at"] = time.monotonic()
        back["server"] = mlflow_server(port, folder / "server")
        back["up"] = time.monotonic()

    t0 = time.monotonic()
    proc = command("run", str(cfg_file), "--quiet")
    try:
        down = None
        while proc.poll() is None:
            if down is None and committed(folder / "runs", rnd):
                stop(server)
                down = time.monotonic()
                say(f"tracking: server killed as round {rnd} committed; back in {away_s:g} s")
                threading.Thread(target=restart, daemon=True).start()
            time.sleep(0.05)
        out = proc.communicate()[0]
        ended = time.monotonic()
        while "server" not in back and down is not None:  # to read the run back
            time.sleep(0.5)
        run_dir = committed(folder / "runs", cfg.rounds)[0]
        gaps = record_gaps(run_dir)
        return {"kind": "tracking", "round": rnd, "away_s": away_s, "exit": proc.returncode,
                "landed": f"after round {rnd}'s commit" if down else "not fired", "tail": out.strip().splitlines()[-1:],
                "longest_round_gap_s": round(max(gaps), 2) if gaps else None,
                "run_s": round(ended - t0, 2), "waited_for_server_s": round(max(0.0, ended - (down or ended)), 2),
                "cost_s": round(ended - t0 - calm_s, 2),
                **_verdict(run_dir, calm_dir, logged_once(uri, folder.name), cfg.rounds)}
    finally:
        stop(proc)
        stop(server)
        stop(back.get("server"))


def study_kill(sweep_path: str, scratch: Path, say: Callable[[str], None]) -> dict:
    """``fedsweep tune SWEEP`` SIGKILLed once its first trial finished and another has committed a round,
    then ``--resume``; beside the same study undisturbed."""
    from fedsweep.config.sweep import load_sweep

    sweep, base = load_sweep(sweep_path)
    rounds = int(base.get("rounds", 2))
    results = {}
    for name in ("calm", "cut"):
        folder = scratch / "study" / name
        folder.mkdir(parents=True, exist_ok=True)
        raw = yaml.safe_load(Path(sweep_path).read_text())
        raw.update(name=f"{sweep.name}-{name}", tracking_uri=f"sqlite:///{scratch / 'study' / 'mlflow.db'}",
                   storage=str(folder / "tune"), experiment=str(Path(sweep.experiment).resolve()))
        path = folder / "sweep.yaml"
        path.write_text(yaml.safe_dump(raw))
        t0 = time.monotonic()
        proc = command("tune", str(path), "--no-report", cwd=folder)
        landed = None
        if name == "cut":
            while proc.poll() is None and landed is None:
                done = committed(folder / "tune", rounds)  # (a trial's checkpoints are in the study's folder)
                part = [p for r in range(1, rounds) for p in committed(folder / "tune", r) if p not in done]
                if done and part:
                    os.kill(proc.pid, signal.SIGKILL)
                    landed = f"{len(done)} trial(s) finished, one part-way"
                time.sleep(0.05)
            proc.communicate(timeout=120)
            say(f"study: driver killed ({landed}); resuming")
            time.sleep(3)
            proc = command("tune", str(path), "--no-report", "--resume", cwd=folder)
        out = proc.communicate(timeout=7200)[0]
        results[name] = {"exit": proc.returncode, "seconds": time.monotonic() - t0, "landed": landed,
                         "tail": out.strip().splitlines()[-1:], "runs": _trial_losses(raw["tracking_uri"], raw["name"])}
    calm, cut = results["calm"]["runs"], results["cut"]["runs"]
    return {"kind": "study", "trials": len(calm["trials"]), "landed": results["cut"]["landed"],
            "exit": results["cut"]["exit"], "cost_s": round(results["cut"]["seconds"] - results["calm"]["seconds"], 2),
            "equal_final_losses": calm["trials"] == cut["trials"], "parent": cut["parent"],
            "child_runs": cut["children"], "metrics_once": cut["once"]}


def setup_kill(cfg, scratch: Path, calm_dir: Path, calm_s: float, say: Callable[[str], None]) -> dict:
    """The driver SIGKILLed inside its set-up (its MLflow run made and its id in run.json, no round
    committed yet), then ``fedsweep run --resume``: one run for the folder, FINISHED, every metric once."""
    folder = scratch / "setup"
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    cfg_file = _config_file(cfg, folder, uri)
    t0 = time.monotonic()
    proc = command("run", str(cfg_file), "--quiet")
    landed = None
    while proc.poll() is None and landed is None:
        for info in (folder / "runs").glob("*/*/run.json"):
            try:
                has_id = bool(json.loads(info.read_text()).get("run_id"))
            except (OSError, ValueError):
                continue
            if has_id and not committed(folder / "runs", 1):
                os.kill(proc.pid, signal.SIGKILL)
                landed = "set-up: the MLflow run made, no round committed"
                break
        time.sleep(0.01)
    proc.communicate(timeout=120)
    if landed is None:
        return {"kind": "setup", "landed": "not fired (a round committed first)"}
    say("setup: driver killed inside its set-up; resuming")
    time.sleep(3)
    again = command("run", str(cfg_file), "--quiet", "--resume")
    out = again.communicate(timeout=3600)[0]
    total = time.monotonic() - t0
    run_dir = committed(folder / "runs", cfg.rounds)[0]
    return {"kind": "setup", "landed": landed, "exit": again.returncode, "tail": out.strip().splitlines()[-1:],
            "cost_s": round(total - calm_s, 2), **_verdict(run_dir, calm_dir, logged_once(uri, folder.name), cfg.rounds)}


def tracking_start(cfg, scratch: Path, away_s: float, calm_dir: Path, calm_s: float,
                   say: Callable[[str], None]) -> dict:
    """``fedsweep run`` started while its ``mlflow server`` is not up; the server starts ``away_s`` later.
    The run trains meanwhile (no round waits: the longest gap between rounds' records), ends FINISHED
    with every metric once, rc 0, final state bitwise the undisturbed one."""
    folder = scratch / "tracking-start"
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    cfg_file = _config_file(cfg, folder, uri)
    back: dict[str, Any] = {}

    def start_late() -> None:
        time.sleep(away_s)
        back["server"] = mlflow_server(port, folder / "server")

    say(f"tracking-start: the run starts with no server; it comes up in {away_s:g} s")
    threading.Thread(target=start_late, daemon=True).start()
    t0 = time.monotonic()
    proc = command("run", str(cfg_file), "--quiet")
    try:
        out = proc.communicate(timeout=7200)[0]
        ended = time.monotonic()
        while "server" not in back:
            time.sleep(0.5)
        run_dir = committed(folder / "runs", cfg.rounds)[0]
        gaps = record_gaps(run_dir)
        return {"kind": "tracking-start", "away_s": away_s, "exit": proc.returncode,
                "tail": out.strip().splitlines()[-1:], "longest_round_gap_s": round(max(gaps), 2) if gaps else None,
                "run_s": round(ended - t0, 2), "cost_s": round(ended - t0 - calm_s, 2),
                **_verdict(run_dir, calm_dir, logged_once(uri, folder.name), cfg.rounds)}
    finally:
        stop(proc)
        stop(back.get("server"))


def study_tracking(sweep_path: str, scratch: Path, away_s: float, say: Callable[[str], None]) -> dict:
    """``fedsweep tune SWEEP`` whose ``mlflow server`` is killed as soon as the study began (its parent
    run made) and back ``away_s`` later, so that trials start and end while it is away; beside the same
    study with the server up throughout. Every trial FINISHED once, the parent FINISHED, every round's
    metrics once, the final test losses equal."""
    from fedsweep.config.sweep import load_sweep

    sweep, _ = load_sweep(sweep_path)
    results = {}
    for name in ("calm", "away"):
        folder = scratch / "study-tracking" / name
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        server = mlflow_server(port, folder / "server")
        uri = f"http://127.0.0.1:{port}"
        raw = yaml.safe_load(Path(sweep_path).read_text())
        raw.update(name=f"{sweep.name}-{name}", tracking_uri=uri, storage=str(folder / "tune"),
                   experiment=str(Path(sweep.experiment).resolve()))
        path = folder / "sweep.yaml"
        path.write_text(yaml.safe_dump(raw))
        back: dict[str, Any] = {}
        t0 = time.monotonic()
        proc = command("tune", str(path), "--no-report", cwd=folder)
        try:
            if name == "away":
                while proc.poll() is None and not list((folder / "tune").glob("*/study.json")):
                    time.sleep(0.05)
                stop(server)
                say(f"study-tracking: server killed as the study began; back in {away_s:g} s")

                def restart() -> None:
                    time.sleep(away_s)
                    back["server"] = mlflow_server(port, folder / "server")

                threading.Thread(target=restart, daemon=True).start()
            out = proc.communicate(timeout=7200)[0]
            seconds = time.monotonic() - t0
            while name == "away" and "server" not in back:
                time.sleep(0.5)
            results[name] = {"exit": proc.returncode, "seconds": seconds, "tail": out.strip().splitlines()[-1:],
                             "runs": _trial_losses(uri, raw["name"])}
        finally:
            stop(proc)
            stop(server)
            stop(back.get("server"))
    calm, away = results["calm"]["runs"], results["away"]["runs"]
    return {"kind": "study-tracking", "away_s": away_s, "trials": len(calm["trials"]), "exit": results["away"]["exit"],
            "tail": results["away"]["tail"], "cost_s": round(results["away"]["seconds"] - results["calm"]["seconds"], 2),
            "equal_final_losses": calm["trials"] == away["trials"], "parent": away["parent"],
            "child_runs": away["children"], "metrics_once": away["once"]}


def _trial_losses(uri: str, experiment: str) -> dict[str, Any]:
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    trials = [r for r in runs if r.data.tags.get("fedsweep.kind") == "trial"]
    return {"parent": [r.info.status for r in runs if r.data.tags.get("fedsweep.kind") == "study"],
            "children": sorted((r.data.tags.get("mlflow.runName", ""), r.info.status) for r in trials),
            "trials": {r.data.tags.get("mlflow.runName", ""): r.data.metrics.get("test_loss") for r in trials},
            "once": all(len({m.step for m in client.get_metric_history(r.info.run_id, "round")})
                        == len(client.get_metric_history(r.info.run_id, "round")) for r in trials)}


def node_loss(cfg, scratch: Path, rnd: int, say: Callable[[str], None], room: bool = True,
              calm: dict[str, Any] | None = None) -> dict:
    """A two-node local Ray cluster (``ray.cluster_utils.Cluster``); the worker node that holds a client
    actor removed inside round ``rnd``. With ``room`` the head has room for its actors: they are placed
    again there and the run goes on from the round it had committed. Without, the run stops with one
    line naming what the cluster lacks, a node is added, and ``--resume`` finishes it. Against the same
    layout undisturbed on the same cluster (the layout decides how clients are grouped, and so the
    float rounding). ``calm``: where the undisturbed run of this layout is kept between the two kinds
    (``dir``, ``seconds``): the head's CPUs differ, the layout and so every result do not; the second
    kind compares against the first's undisturbed run instead of running it again."""
    from ray.cluster_utils import Cluster

    from fedsweep.bench.recovery import Disturber, Timeline, bitwise_equal, final_state
    from fedsweep.config import validate
    from fedsweep.errors import RunError
    from fedsweep.orchestrator.runner import run

    folder = scratch / ("node" if room else "node-no-room")
    raw = cfg.to_dict()
    raw["clients"] = {**raw["clients"], "clients_per_actor": max(1, cfg.clients.num_clients // 2), "num_actors": "auto",
                      "placement_strategy": "SPREAD", "resources": {**raw["clients"]["resources"], "num_cpus": 1}}
    raw["server"] = {**raw["server"], "resources": {**raw["server"]["resources"], "num_cpus": 0.1}}
    raw["tracking"] = {**raw["tracking"], "enabled": False}
    raw["checkpoint"] = {**raw["checkpoint"], "enabled": True, "dir": str(folder / "runs")}
    node_cfg = validate(raw)
    calm_raw = {**raw, "checkpoint": {**raw["checkpoint"], "dir": str(folder / "calm")}}
    # the head: the server and one client actor, and (with room) one more; the worker: one client actor
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3 if room else 2,
                                                             "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1)
    fired: dict[str, Any] = {}

    class NodeKiller(Disturber):
        def _fire(self, at: int, where: str) -> None:
            import ray

            if at != rnd or fired:
                return
            hosts = ray.get([a.node_id.remote() for a in self.actors], timeout=60)
            if worker.node_id in hosts:
                fired["landed"] = f"{where} round {at}"
                fired["actors"] = [i for i, h in enumerate(hosts) if h == worker.node_id]
                cluster.remove_node(worker, allow_graceful=False)

    os.environ["RAY_ADDRESS"] = cluster.address
    stopped = None
    try:
        calm = {} if calm is None else calm
        if not calm:
            t0 = time.monotonic()
            calm["dir"] = Path(run(validate(calm_raw)).run_dir)  # the same layout undisturbed (groups decide
            calm["seconds"] = time.monotonic() - t0  # the float rounding)
        calm_dir, calm_s = calm["dir"], calm["seconds"]
        t0 = time.monotonic()
        try:
            out = run(node_cfg, on_event=NodeKiller([], Timeline()))
        except RunError as exc:
            if room:
                raise
            stopped = str(exc)
            say(f"node: the run stopped: {stopped}")
            cluster.add_node(num_cpus=1)  # the cluster gets room again
            out = run(node_cfg, resume=True)
        seconds = time.monotonic() - t0
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        import ray

        ray.shutdown()
        cluster.shutdown()
    say(f"node: worker node removed ({fired.get('landed', 'not fired')})")
    a, b = final_state(calm_dir), final_state(out.run_dir)
    differing = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not bitwise_equal(a[k], b[k]))
    return {"kind": "node" if room else "node-no-room", "round": rnd,
            "landed": fired.get("landed", "not fired (no client actor on the worker)"),
            "actors_moved": fired.get("actors", []), "stopped": stopped, "seconds": round(seconds, 2),
            "cost_s": round(seconds - calm_s, 2), "bitwise_equal": not differing, "differing": differing[:10]}


def run_outages(cfg, kinds: list[str], scratch: Path, seed: int, calm_dir: Path, calm_s: float, away_s: float,
                study: str | None, say: Callable[[str], None]) -> list[dict]:
    """Each asked kind once, at a seeded round (never the last, so that something is left to recover)."""
    import numpy as np

    gen = np.random.default_rng(seed)  # the bench's own schedule (as ``bench.recovery``'s), no run stream
    out = []
    node_calm: dict[str, Any] = {}  # the node kinds' one undisturbed run
    for kind in kinds:
        rnd = int(gen.integers(1, max(2, cfg.rounds)))
        shutil.rmtree(scratch / kind, ignore_errors=True)
        if kind == "commit":
            out.append(commit_kill(cfg, scratch, rnd, calm_dir, calm_s, say))
        elif kind == "tracking":
            out.append(tracking_outage(cfg, scratch, rnd, away_s, calm_dir, calm_s, say))
        elif kind == "study":
            if not study:
                raise ValueError("--kinds study needs --study SWEEP (the study whose driver is killed)")
            out.append(study_kill(study, scratch, say))
        elif kind in ("node", "node-no-room"):
            out.append(node_loss(cfg, scratch, rnd, say, room=kind == "node", calm=node_calm))
        elif kind == "setup":
            out.append(setup_kill(cfg, scratch, calm_dir, calm_s, say))
        elif kind == "tracking-start":
            out.append(tracking_start(cfg, scratch, away_s, calm_dir, calm_s, say))
        elif kind == "study-tracking":
            if not study:
                raise ValueError("--kinds study-tracking needs --study SWEEP (the study whose server goes away)")
            out.append(study_tracking(study, scratch, away_s, say))
    return out


def summary_line(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k not in ("differing", "tail")})
