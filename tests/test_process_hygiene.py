"""A local run's Ray runtime listens on loopback only, and leaves no process behind — after a normal
exit and after its driver is killed (checked by PID, and with ``ss -ltnp`` for the sockets)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _listening(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-H", "-ltnp"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def _config(tmp_path: Path, rounds: int) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "experiments" / "smoke.yaml").read_text())
    raw["rounds"] = rounds
    raw["clients"]["clients_per_actor"] = 4  # one client actor: the run's processes, not its layout, are checked
    raw["checkpoint"] = {"dir": str(tmp_path / "runs")}
    raw["tracking"] = {"enabled": False}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _start(cfg: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    return subprocess.Popen([sys.executable, "-m", "fedsweep.cli", "run", str(cfg), "--quiet"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for_actors(proc: subprocess.Popen, timeout: float = 120) -> set[int]:
    """PIDs of the run's whole process tree once its client actors are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree = {p.pid for p in _descendants(proc.pid)}
        names = " ".join(p.name() for p in _descendants(proc.pid) if p.is_running())
        if "ClientActor" in names or "ray::ClientA" in names:
            return tree | {proc.pid}
        time.sleep(0.5)
    raise AssertionError("no client actor came up")


def _command(pid: int) -> str | None:
    """A live process's first three words of its command line (None where it has exited or is a zombie
    not yet reaped: one of Ray's short-lived helpers can be, the moment the tree is read)."""
    try:
        return " ".join(psutil.Process(pid).cmdline()[:3])
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def _all_ray_pids_started_by(pids: set[int]) -> set[int]:
    out = set(pids)
    for p in list(pids):
        out |= {c.pid for c in _descendants(p)}
    return out


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_local_run_listens_on_loopback_only_and_exits_clean(tmp_path):
    proc = _start(_config(tmp_path, rounds=2))
    pids = _wait_for_actors(proc)
    time.sleep(1.0)
    pids = _all_ray_pids_started_by(pids)
    sockets = _listening(pids)
    assert sockets, "no listening socket found for the run"
    loopback = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")
    exposed = [s for s in sockets if s.split()[3].rsplit(":", 1)[0] not in loopback]
    assert not exposed, exposed
    commands = [c for c in map(_command, pids) if c is not None]
    assert any("raylet" in c for c in commands), commands
    assert not [c for c in commands if "dashboard/dashboard.py" in c], commands  # no API server in a local run
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    time.sleep(2.0)
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, [psutil.Process(p).cmdline()[:2] for p in left]


@pytest.mark.system
def test_a_killed_driver_leaves_no_ray_process_behind(tmp_path):
    proc = _start(_config(tmp_path, rounds=20))
    pids = _all_ray_pids_started_by(_wait_for_actors(proc))
    os.killpg(proc.pid, 0)  # still alive
    proc.send_signal(signal.SIGKILL)  # the driver only; its children are on their own now
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    left = pids
    while time.monotonic() < deadline:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.5)
    assert not left, [" ".join(psutil.Process(p).cmdline()[:2]) for p in left if psutil.pid_exists(p)]


EARLY_START = r'''
import json, os, time
import psutil, ray
from fedsweep.orchestrator.runtime import local_node, ray_runtime

out = {}
assert ray_runtime.start_while(lambda a, b: a + b, 2, 3) == 5
children = psutil.Process().children(recursive=True)
out["processes"] = [" ".join(p.cmdline()[:3]) for p in children]
out["agent_commands"] = [a for p in children for a in p.cmdline() if a.startswith("--dashboard_agent_command=")]
out["cpus_early"] = ray.cluster_resources()["CPU"]
RETRY = list(local_node.SOCKET_RETRY_ENV)
def retry_env_of_raylet():
    raylet = [p for p in psutil.Process().children(recursive=True) if p.cmdline()[:1] and p.cmdline()[0].endswith("raylet")]
    return [raylet[0].environ().get(k) for k in RETRY]
out["retry_env"] = retry_env_of_raylet()
node = ray.get_runtime_context().get_node_id()
gcs = ray._private.worker._global_node.gcs_address
sleeps, sleep = [], time.sleep
time.sleep = lambda s: (sleeps.append(s), sleep(s))
local_node.wait_registered(gcs, node, timeout_s=5.0)
out["sleeps_registered"] = list(sleeps)
sleeps.clear()
local_node.wait_registered(gcs, "ab" * 28, timeout_s=0.3)  # never registers: gives up at the timeout
out["sleeps_absent"] = list(sleeps)
time.sleep = sleep
out["kept"] = ray_runtime.ensure(0) and ray.get_runtime_context().get_node_id() == node
ray.shutdown()
assert ray_runtime.start_while(lambda: None) is None
asked = ray_runtime.local_cpus() + 2
os.environ[RETRY[0]] = "700"  # the user's own setting is kept
out["restarted"] = ray_runtime.ensure(asked, log_to_driver=False)
out["retry_env_user"] = retry_env_of_raylet()
out["retry_env_worker"] = ray.get(ray.remote(lambda: [os.environ.get(k) for k in RETRY]).remote(), timeout=60)
out["cpus_restarted"] = ray.cluster_resources()["CPU"]
out["processes_unforwarded"] = [" ".join(p.cmdline()[:3]) for p in psutil.Process().children(recursive=True)]
out["asked"] = asked
out["square"] = ray.get(ray.remote(lambda x: x * x).remote(7), timeout=60)
ray.shutdown()
print("RESULT " + json.dumps(out))
'''


def test_ray_starts_while_the_config_is_validated(tmp_path):
    """``start_while``: the config finds the runtime up and ``ensure`` keeps it (one start), with no dashboard
    API server process and a minimal dashboard agent; the wait for the raylet's registration asks the GCS
    until it is there, and gives up at its timeout; a config asking more logical CPUs than the early runtime
    has gets a new, larger one; a runtime whose workers' output is not forwarded runs no log monitor; the
    runtime's processes retry a missing socket every 50 ms, unless the user set it."""
    import json

    script = tmp_path / "early.py"
    script.write_text(EARLY_START)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    line = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    assert out["kept"] is True
    assert out["cpus_early"] == (os.cpu_count() or 1) + 1
    assert not [p for p in out["processes"] if "dashboard/dashboard.py" in p], out["processes"]
    assert any("raylet" in p for p in out["processes"]), out["processes"]
    assert len(out["agent_commands"]) == 1 and "--minimal" in out["agent_commands"][0].split(), out["agent_commands"]
    assert out["sleeps_registered"] == []  # a registered node is found on the first ask
    assert len(out["sleeps_absent"]) >= 3 and max(out["sleeps_absent"]) < 0.1  # asked often, then given up
    assert out["restarted"] is True and out["cpus_restarted"] == out["asked"]
    # the workers' output forwarded (the default) needs the log monitor; not forwarded, none runs
    assert [p for p in out["processes"] if "log_monitor.py" in p], out["processes"]
    assert any("raylet" in p for p in out["processes_unforwarded"]), out["processes_unforwarded"]
    assert not [p for p in out["processes_unforwarded"] if "log_monitor.py" in p], out["processes_unforwarded"]
    assert out["square"] == 49
    # a socket not yet there is asked again every 50 ms, in every process Ray starts
    assert out["retry_env"] == ["50", "200"]
    assert out["retry_env_user"] == ["700", "200"] and out["retry_env_worker"] == ["700", "200"]


def test_the_socket_retry_settings_are_ones_ray_reads_and_keep_its_total_wait():
    """Ray's own configuration, read in fresh processes: without the variables its retry is 1,000 ms ×
    10 attempts; with :data:`SOCKET_RETRY_ENV` it reads 50 ms × 200, the same 10 s in all (a renamed
    setting in a later Ray would read its default here)."""
    from fedsweep.orchestrator.runtime.local_node import SOCKET_RETRY_ENV

    code = ("import ray._raylet as r; c = r.Config; "
            "print(c.raylet_client_connect_timeout_milliseconds(), c.raylet_client_num_connect_attempts())")
    clean = {k: v for k, v in os.environ.items() if k not in SOCKET_RETRY_ENV}

    def read(env):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return [int(x) for x in done.stdout.split()]

    ray_sleep_ms, ray_attempts = read(clean)
    ours = read({**clean, **SOCKET_RETRY_ENV})
    assert ours == [50, 200] and ours != [ray_sleep_ms, ray_attempts]
    assert ours[0] * ours[1] == ray_sleep_ms * ray_attempts


def test_a_config_error_wins_over_the_runtime_started_beside_it(monkeypatch):
    """The config's error is raised (not Ray's, not a success) and the runtime started beside it is
    stopped; Ray's own error is raised when the config is fine."""
    from fedsweep.errors import ConfigError
    from fedsweep.orchestrator.runtime import ray_runtime

    import ray

    stopped = []
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))

    def bad():
        raise ConfigError("clients.fraction = 3: not in (0, 1]")

    monkeypatch.setattr(ray_runtime, "ensure", lambda cpus, log_to_driver=True: True)
    with pytest.raises(ConfigError, match="clients.fraction"):
        ray_runtime.start_while(bad)
    assert stopped == [True] and ray_runtime._STARTED_EARLY is None

    def ray_fails(cpus, log_to_driver=True):
        raise RuntimeError("raylet did not start")

    monkeypatch.setattr(ray_runtime, "ensure", ray_fails)
    with pytest.raises(ConfigError, match="clients.fraction"):  # both fail: the user's error first
        ray_runtime.start_while(bad)
    with pytest.raises(RuntimeError, match="raylet did not start"):
        ray_runtime.start_while(lambda: 1)
    assert stopped == [True] and ray_runtime._STARTED_EARLY is None
