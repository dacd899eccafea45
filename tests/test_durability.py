"""Nothing lost when anything dies: a round's record is durable with its commit and logged once, and
tracking survives its server (``orchestrator/tracking/outbox.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedsweep.bench.outages import free_port, mlflow_server, record_gaps, stop

ROOT = Path(__file__).resolve().parents[1]


class FlakyClient:
    """An MLflow client whose server does not answer its first ``down`` calls (a connection error, as
    requests raises it), then records what it is sent."""

    def __init__(self, down: int):
        self.down, self.calls, self.got = down, 0, []

    def _call(self, what, *args, **kw):
        self.calls += 1
        if self.calls <= self.down:
            raise ConnectionError("Max retries exceeded with url: /api/2.0/mlflow/runs/log-batch")
        self.got.append((what, args, kw))

    def log_batch(self, run, metrics=(), params=(), tags=()):
        self._call("batch", run, [(m.key, m.value, m.timestamp, m.step) for m in metrics], list(params), list(tags))

    def set_terminated(self, run, status):
        self._call("status", run, status)

    def log_artifact(self, run, local, path):
        self._call("artifact", run, Path(local).read_bytes(), path)


def test_the_outbox_keeps_every_write_on_disk_while_the_server_is_away_and_sends_them_in_order(tmp_path):
    """Writes return at once whatever the server does; while it does not answer they wait on disk (and
    survive the process: a new outbox on the folder finds them), the console is told once, and when it
    answers again they are sent in the order they were made, the status last."""
    from fedsweep.orchestrator.tracking.outbox import Outbox

    said = []
    client = FlakyClient(down=3)
    box = Outbox("http://127.0.0.1:9", tmp_path / "box", said.append, start=False, client=client)
    t0 = time.perf_counter()
    box.batch("r", metrics=[("loss", 1.5, 1000, 1)])
    box.artifact("r", "round_0001/x.txt", b"hello")
    box.batch("r", metrics=[("round", 1.0, 1000, 1)])
    box.status("r", "FINISHED")
    assert time.perf_counter() - t0 < 1.0 and box.waiting() == 4
    assert not box.deliver_one(client) and box.waiting() == 4 and "does not answer: 4 record(s) wait" in said[0]
    box.close()  # (the process gone: its lock with it)
    again = Outbox("http://127.0.0.1:9", tmp_path / "box", said.append, start=False, client=client)  # a new process
    assert again.waiting() == 4
    while again.waiting():
        again.deliver_one(client)
    assert [g[0] for g in client.got] == ["batch", "artifact", "batch", "status"]
    assert client.got[0][1] == ("r", [("loss", 1.5, 1000, 1)], [], []) and client.got[1][1][1] == b"hello"
    assert client.got[3][1] == ("r", "FINISHED") and any("answers again" in line for line in said)


def test_the_sender_thread_delivers_when_the_server_comes_back_and_drain_waits_for_it(tmp_path):
    from fedsweep.orchestrator.tracking.outbox import Outbox

    client = FlakyClient(down=2)
    box = Outbox("http://127.0.0.1:9", tmp_path / "box", client=client)
    box.batch("r", metrics=[("m", 2.0, 5, 3)])
    assert box.drain(20.0) == 0 and client.got[0][1][1] == [("m", 2.0, 5, 3)]
    box.close()
    never = Outbox("http://127.0.0.1:9", tmp_path / "other", client=FlakyClient(down=10 ** 6))
    never.batch("r", metrics=[("m", 2.0, 5, 3)])
    t0 = time.perf_counter()
    assert never.drain(1.0) == 1 and time.perf_counter() - t0 < 3.0  # gives up at wait_s, the write kept
    never.close()


def test_a_write_sent_twice_is_logged_once_and_a_refused_one_is_set_aside(tmp_path):
    """Metrics carry the timestamp they were first given, so MLflow logs a batch sent twice once (a
    resumed run, or an outbox file whose deletion a crash interrupted); a write the server refuses as
    malformed is kept beside the others with the reason instead of holding them back."""
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient
    from fedsweep.orchestrator.tracking.outbox import Outbox, send

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("twice")).info.run_id
    op = {"op": "batch", "run": run, "metrics": [["loss", 0.5, 1234, 1], ["loss", 0.4, 1240, 2]], "params": [],
          "tags": []}
    send(client, op)
    send(client, op)
    assert [(m.step, m.value) for m in client.get_metric_history(run, "loss")] == [(1, 0.5), (2, 0.4)]
    said = []
    box = Outbox(uri, tmp_path / "box", said.append, start=False, client=client)
    box.batch("no-such-run", metrics=[("loss", 1.0, 1, 1)])
    box.batch(run, metrics=[("loss", 0.3, 1300, 3)])
    while box.waiting():
        box.deliver_one(client)
    assert [m.step for m in client.get_metric_history(run, "loss")] == [1, 2, 3]
    assert len(list((tmp_path / "box").glob("*.refused.json"))) == 1 and "refused" in said[0]


def _smoke_file(tmp_path: Path, tracking_uri: str, rounds: int, **sections) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "experiments" / "smoke.yaml").read_text())
    raw["rounds"] = rounds
    raw["clients"]["clients_per_actor"] = 4
    raw["checkpoint"] = {"dir": str(tmp_path / "runs"), "keep": 1}
    raw["tracking"] = {"uri": tracking_uri, "experiment": f"durable-{tmp_path.name}", "wait_s": 120}
    raw["eval"] = {**raw.get("eval", {}), "max_new_tokens": 0}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _driver(cfg: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-m", "fedsweep.cli", "run", str(cfg), "--quiet", *extra], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _history(uri: str, experiment: str, key: str) -> tuple[list, list[int]]:
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    steps = sorted(m.step for r in runs for m in client.get_metric_history(r.info.run_id, key))
    return [r.info.status for r in runs], steps


@pytest.mark.system
def test_a_driver_killed_between_a_rounds_commit_and_its_metrics_loses_no_round(tmp_path, tracking_uri):
    """The issue's window: SIGKILL of the driver as soon as round 2's checkpoint is committed (its
    metrics not yet logged: a round is logged once committed, and round 2's commit lands while round 3
    trains); ``--resume`` from round 2 logs round 2 from its record in the journal, and every round's
    metrics end up logged exactly once in one FINISHED run."""
    cfg = _smoke_file(tmp_path, tracking_uri, rounds=4, train={"steps": 8})
    proc = _driver(cfg)
    deadline = time.monotonic() + 240
    committed = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").glob("*/*/checkpoints/round_0002/COMPLETE"))
        if found:
            committed = found[0].parent
            os.kill(proc.pid, signal.SIGKILL)  # the driver alone: its watchdog ends its Ray processes
            break
        time.sleep(0.02)
    out = proc.communicate(timeout=60)[0]
    assert committed is not None, out
    records = committed.parent / "records"
    assert (records / "round_0002.json").exists()  # the record came first: a committed round has it
    assert not (records / "round_0002.queued").exists(), "the kill missed the window (round 2 already logged)"
    experiment = f"durable-{tmp_path.name}"
    assert 2 not in _history(tracking_uri, experiment, "train_loss")[1]
    time.sleep(3)  # the watchdog ends the killed run's Ray processes
    again = _driver(cfg, "--resume")
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    statuses, steps = _history(tracking_uri, experiment, "train_loss")
    assert statuses == ["FINISHED"] and steps == [1, 2, 3, 4], (statuses, steps)
    assert _history(tracking_uri, experiment, "round")[1] == [1, 2, 3, 4]
    assert json.loads((records / "round_0002.json").read_text())["round"] == 2


@pytest.mark.system
def test_a_driver_killed_inside_its_set_up_resumes_into_its_one_mlflow_run(tmp_path, tracking_uri):
    """The set-up window: SIGKILL of the driver as soon as its MLflow run exists (its id in run.json, the
    actors still starting); ``--resume`` continues that run: one run for the folder, FINISHED, nothing
    left RUNNING, every round's metrics once, and the final tensors those of an undisturbed run."""
    from fedsweep.reproduce.bitwise import digests

    cfg = _smoke_file(tmp_path, tracking_uri, rounds=3)
    proc = _driver(cfg)
    deadline, killed = time.monotonic() + 240, None
    while time.monotonic() < deadline and proc.poll() is None:
        for info in (tmp_path / "runs").glob("*/*/run.json"):
            try:
                data = json.loads(info.read_text())
            except ValueError:  # (never half written: a whole file replaces it)
                raise
            if data.get("run_id"):
                os.kill(proc.pid, signal.SIGKILL)
                killed = info.parent
                break
        if killed:
            break
        time.sleep(0.01)
    out = proc.communicate(timeout=60)[0]
    assert killed is not None, out
    assert not list(killed.glob("checkpoints/round_*/COMPLETE")), "the kill missed the window (a round committed)"
    time.sleep(3)  # the watchdog ends the killed run's Ray processes
    again = _driver(cfg, "--resume")
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    experiment = f"durable-{tmp_path.name}"
    statuses, steps = _history(tracking_uri, experiment, "round")
    assert statuses == ["FINISHED"] and steps == [1, 2, 3], (statuses, steps)
    resumed = json.loads((killed / "run.json").read_text())
    assert resumed["ended"] == "FINISHED" and "driver" not in resumed
    undisturbed = tmp_path / "plain"
    plain = _smoke_file(undisturbed, tracking_uri, rounds=3) if undisturbed.mkdir() is None else None
    assert _driver(plain).communicate(timeout=300) is not None
    last = lambda root: sorted(root.glob("runs/*/*/checkpoints/round_0003"))[-1]  # noqa: E731
    assert digests(last(tmp_path)) == digests(last(undisturbed))


def test_a_resume_whose_first_driver_never_kept_the_run_id_continues_the_run_of_its_folder(ray_session, smoke_raw):
    """The narrow window the set-up test cannot hit: the MLflow run created, the driver killed before
    run.json had its id. The resume finds the run tagged with the same folder and continues it (one run,
    FINISHED, every round once); and a run of the config whose driver is gone without ending it is marked
    KILLED by the next run that opens the config's folder."""
    from fedsweep.config import validate
    from fedsweep.orchestrator.run_dirs import read_run_info, write_run_info
    from fedsweep.orchestrator.runner import RunError, run
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    smoke_raw["rounds"] = 3
    smoke_raw["tracking"]["experiment"] = "identity"  # (the session's store: its own experiment)
    cfg = validate(smoke_raw)
    with pytest.raises(RunError, match="stop_after"):
        run(cfg, stop_after=1)
    client = MlflowClient(smoke_raw["tracking"]["uri"])
    exp = client.get_experiment_by_name(cfg.tracking.experiment or cfg.name).experiment_id
    first = client.search_runs([exp])
    assert len(first) == 1
    folder = Path(first[0].data.tags["fedsweep.run_dir"])
    info = read_run_info(folder)
    info["run_id"] = None  # as if killed before run.json had it
    write_run_info(folder, info)
    outcome = run(cfg, resume=True)
    runs = client.search_runs([exp])
    assert [r.info.run_id for r in runs] == [first[0].info.run_id] == [outcome.run_id]
    assert runs[0].info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(outcome.run_id, "round")) == [1, 2, 3]
    # a run whose driver vanished (a lease naming a process that is gone), found by the next run
    with pytest.raises(RunError, match="stop_after"):
        run(cfg, stop_after=1)
    stale = [r for r in client.search_runs([exp]) if r.info.run_id != outcome.run_id][0]
    folder = Path(stale.data.tags["fedsweep.run_dir"])
    info = read_run_info(folder)
    info.pop("ended")
    info["driver"] = {"host": __import__("socket").gethostname(), "pid": 2 ** 22 + 17, "started": 1.0}
    write_run_info(folder, info)
    client.update_run(stale.info.run_id, status="RUNNING")  # (what a killed driver leaves)
    run(validate({**smoke_raw, "rounds": 1}))
    assert client.get_run(stale.info.run_id).info.status == "KILLED"
    assert read_run_info(folder)["ended"] == "KILLED"


@pytest.mark.system
def test_training_goes_on_while_the_tracking_server_is_away_and_the_run_ends_with_every_metric(tmp_path):
    """A real ``mlflow server`` on a loopback port, SIGKILLed as soon as round 2 commits and back 12 s
    later: no round waits for it (the server stamps each round's record when the round ends: no two
    rounds are further apart than a round takes), and the run ends FINISHED with every round's
    metrics once and its artifacts."""
    where = tmp_path / "server"
    where.mkdir()
    port = free_port()
    server = mlflow_server(port, where)
    uri = f"http://127.0.0.1:{port}"
    cfg = _smoke_file(tmp_path, uri, rounds=6, train={"steps": 4})
    cfg.write_text(cfg.read_text().replace("wait_s: 120", "wait_s: 900"))
    proc = _driver(cfg)
    killed_at, back = None, {}
    import threading

    def restart():  # back 12 s after it went away (its own start takes a while more), beside the run
        time.sleep(12)
        back["server"] = mlflow_server(port, where)

    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            if killed_at is None and list((tmp_path / "runs").glob("*/*/checkpoints/round_0002/COMPLETE")):
                stop(server)
                killed_at = time.monotonic()
                threading.Thread(target=restart, daemon=True).start()
            time.sleep(0.05)
        out = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, out
        assert killed_at is not None and "does not answer" in out, out
        run_dir = next((tmp_path / "runs").glob("*/*"))
        gaps = record_gaps(run_dir)
        assert len(gaps) == 5 and max(gaps) < 10.0, gaps  # (a round of this run takes about 1-3 s; MLflow's own retries take minutes)
        # read back from the server that came back (the run could only end FINISHED through it)
        statuses, steps = _history(uri, f"durable-{tmp_path.name}", "train_loss")
        assert statuses == ["FINISHED"] and steps == [1, 2, 3, 4, 5, 6], (statuses, steps)
        from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

        client = MlflowClient(uri)
        run = client.search_runs([client.get_experiment_by_name(f"durable-{tmp_path.name}").experiment_id])[0]
        assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "clients.json"}
        assert not list(run_dir.glob("tracking-outbox/0*.json"))  # everything delivered
    finally:
        stop(proc)
        for srv in (server, back.get("server")):
            stop(srv)


def _study_file(tmp_path: Path, uri: str, name: str) -> Path:
    raw = {"name": name, "experiment": str(ROOT / "configs/experiments/smoke.yaml"),
           "set": ["clients.clients_per_actor=4", "rounds=2", "eval_every=2", "eval.max_new_tokens=0", "train.steps=16",
                   "checkpoint.keep=1"],
           "variants": {"fedavg": {"algorithm": "fedavg"}}, "seeds": [0, 1, 2], "max_concurrent_trials": 1,
           "metric": "test_loss", "mode": "min", "tracking_uri": uri, "storage": str(tmp_path / "tune")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _tune(sweep: Path, cwd: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-m", "fedsweep.cli", "tune", str(sweep), *extra], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _final_losses(uri: str, name: str) -> dict[str, tuple[str, float]]:
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    trials = [r for r in runs if r.data.tags.get("fedsweep.kind") == "trial"]
    out = {}
    for r in trials:
        assert r.data.tags["seed"] not in out, f"two child runs of seed {r.data.tags['seed']}"
        assert len(client.get_metric_history(r.info.run_id, "test_loss")) == 1  # logged once
        out[r.data.tags["seed"]] = (r.info.status, r.data.metrics["test_loss"])
    parents = [r.info.status for r in runs if r.data.tags.get("fedsweep.kind") == "study"]
    return {"parent": parents, **out}


@pytest.mark.system
def test_a_study_whose_driver_is_killed_resumes_every_trial_to_the_undisturbed_result(tmp_path):
    """``fedsweep tune`` SIGKILLed once its first trial finished and its second is part-way (its Ray
    processes ended by its watchdog, as a crash leaves them); ``fedsweep tune SWEEP --resume`` keeps the
    finished trial, continues the cut one from its own last committed round (its MLflow run continued,
    never left RUNNING), runs the third, ends the study run FINISHED and writes the report; every
    trial's final test loss equals an undisturbed study's, one FINISHED child run each."""
    from fedsweep.storage import named_below  # (a walk that passes over a round renamed at its commit)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "calm").mkdir()
    calm = _tune(_study_file(tmp_path / "calm", uri, "calm"), tmp_path / "calm")
    out = calm.communicate(timeout=900)[0]
    assert calm.returncode == 0, out
    (tmp_path / "cut").mkdir()
    sweep = _study_file(tmp_path / "cut", uri, "cut")
    proc = _tune(sweep, tmp_path / "cut")
    deadline, killed = time.monotonic() + 600, False
    while time.monotonic() < deadline and proc.poll() is None:
        trials = [p.parent for p in named_below(tmp_path / "cut" / "tune", "checkpoints")]  # (each trial's own folder)
        done = [t for t in trials if (t / "checkpoints" / "round_0002" / "COMPLETE").exists()]
        cut = [t for t in trials if t not in done and list(t.glob("checkpoints/round_0001/COMPLETE"))]
        if done and cut:
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    out = proc.communicate(timeout=60)[0]
    assert killed, out
    time.sleep(3)  # its watchdog ends its Ray processes
    again = _tune(sweep, tmp_path / "cut", "--resume")
    out = again.communicate(timeout=900)[0]
    assert again.returncode == 0, out
    got, want = _final_losses(uri, "cut"), _final_losses(uri, "calm")
    assert got["parent"] == ["FINISHED"] and sorted(k for k in got if k != "parent") == ["0", "1", "2"], got
    for seed in ("0", "1", "2"):
        assert got[seed] == want[seed] and got[seed][0] == "FINISHED", (seed, got, want)
    assert (tmp_path / "cut" / "results" / "reports" / "cut" / "report.md").is_file()


@pytest.mark.system
def test_a_lost_worker_node_is_recovered_bitwise_or_stops_in_one_line_and_resumes(tmp_path):
    """``fedsweep bench faults --kinds node,node-no-room`` on a two-node local Ray cluster: the worker
    node that holds a client actor is removed inside a round. With room on the head, the actor is
    placed again there and the run ends bitwise equal to the same layout undisturbed; without, the
    run stops in one line naming what the cluster lacks, and once a node is added ``--resume``
    ends it bitwise equal too."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cfg = _smoke_file(tmp_path, "sqlite:///unused.db", rounds=3, train={"steps": 4})
    done = subprocess.run([sys.executable, "-m", "fedsweep.cli", "bench", "faults", str(cfg), "--kills", "0",
                           "--kinds", "node,node-no-room", "--scratch", str(tmp_path / "scratch"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("*.json")
    outages = {o["kind"]: o for o in json.loads(path.read_text())["outages"]}
    room, none = outages["node"], outages["node-no-room"]
    assert room["landed"].startswith("inside round") and room["actors_moved"] and room["stopped"] is None
    assert room["bitwise_equal"], room
    assert none["landed"].startswith("inside round") and none["bitwise_equal"], none
    assert "lost its node and cannot be placed again" in none["stopped"] and "\n" not in none["stopped"]
