"""Ray's workers forked from the fork server (``orchestrator/runtime/fork_server.py``, started through
``worker_start.py``): the forked worker gets the starter's streams, environment, folder and arguments,
its own process group; the starter forwards the signals that end a worker and exits with its status;
either one's death ends the other; the server declines to fork once Ray's core is loaded in it, and the
starter then execs Ray's own set-up script with the arguments unchanged, as it does for a worker with a
runtime environment of its own; the server ends when its driver does; a forked worker's torch has the
threads a fresh worker's reads. And a run whose workers are forked leaves the same checkpoint, tensor
for tensor, as one whose workers Ray started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedsweep.orchestrator.runtime import fork_server, worker_start

ROOT = Path(__file__).resolve().parents[1]
STARTER = ROOT / "fedsweep" / "orchestrator" / "runtime" / "worker_start.py"

WORKER = r'''
import json, os, signal, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
def term(*_):
    open(out + ".term", "w").write("term")
    sys.exit(7)
signal.signal(signal.SIGTERM, term)
json.dump({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "cwd": os.getcwd(),
           "argv": sys.argv, "name": __name__, "mine": os.environ.get("ONLY_THE_STARTERS"),
           "servers": os.environ.get("ONLY_THE_SERVERS")}, open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
print("hello from the worker", flush=True)
print("and its stderr", file=sys.stderr, flush=True)
if "--stay" in sys.argv:
    time.sleep(120)
sys.exit(3)
'''

RAY_SETUP_STUB = r'''
import json, os, sys
json.dump({"stub_argv": sys.argv[1:], "pid": os.getpid()}, open(os.environ["STUB_OUT"], "w"))
'''


def _wait_for(predicate, timeout: float = 30.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie not yet reaped); it may exit as this looks."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def server(tmp_path):
    """A fork server of this process with a light import list (``json``), and its socket's path."""
    path = str(tmp_path / "forks" / "s")
    os.makedirs(os.path.dirname(path))
    env = {**os.environ, "ONLY_THE_SERVERS": "1", fork_server.SCRIPT_ENV: str(tmp_path / "default_worker.py")}
    proc = subprocess.Popen([sys.executable, "-m", "fedsweep.orchestrator.runtime.fork_server", path, str(os.getpid()),
                             "json"], env=env, cwd=ROOT)
    _wait_for(lambda: os.path.exists(os.path.join(os.path.dirname(path), "ready")))
    yield path, proc
    proc.terminate()
    proc.wait(timeout=10)


def _starter(tmp_path: Path, socket_path: str | None, *worker_args: str, context: str | None = None,
             extra_env: dict | None = None, script_dir: Path | None = None) -> tuple[subprocess.Popen, Path, Path]:
    """The raylet's command line for a worker, pointed at ``tmp_path/default_worker.py`` (the test's worker;
    ``script_dir``: a script of that name elsewhere)."""
    script = (script_dir or tmp_path) / "default_worker.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(WORKER)
    stub = tmp_path / "setup_worker_stub.py"
    stub.write_text(RAY_SETUP_STUB)
    out, log = tmp_path / "worker.json", tmp_path / "worker.out"
    env = {k: v for k, v in os.environ.items() if k not in (fork_server.SOCKET_ENV, "ONLY_THE_SERVERS")}
    env.update({"ONLY_THE_STARTERS": "yes", fork_server.RAY_SETUP_ENV: str(stub), "STUB_OUT": str(tmp_path / "stub.json"),
                **(extra_env or {})})
    if socket_path:
        env[fork_server.SOCKET_ENV] = socket_path
    flags = [f"--serialized-runtime-env-context={context}"] if context is not None else []
    with open(log, "w") as stream:
        proc = subprocess.Popen([sys.executable, str(STARTER), str(script), "--out", str(out), *worker_args,
                                 *flags, "--language=PYTHON"], env=env, cwd=tmp_path, stdout=stream,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out, log


def test_the_starter_reads_rays_two_flags_in_either_form():
    assert worker_start.split_args(["w.py", "--a=1", "--serialized-runtime-env-context", "{}", "--language=PYTHON"]) \
        == ("{}", "PYTHON", ["w.py", "--a=1"])
    assert worker_start.split_args(["w.py", "--language", "JAVA", "--serialized-runtime-env-context={\"x\": 1}"]) \
        == ('{"x": 1}', "JAVA", ["w.py"])
    assert worker_start.split_args(["w.py", "--languages=1"]) == (None, None, ["w.py", "--languages=1"])
    assert worker_start.plain_context(None) and worker_start.plain_context("{}")
    assert worker_start.plain_context(json.dumps({"command_prefix": [], "env_vars": {}, "py_executable": sys.executable,
                                                  "override_worker_entrypoint": None, "java_jars": []}))
    for field, value in (("env_vars", {"A": "1"}), ("command_prefix", ["cd", "/x", "&&"]), ("py_executable", "/other/python"),
                         ("override_worker_entrypoint", "/x.py"), ("java_jars", ["a.jar"])):
        assert not worker_start.plain_context(json.dumps({field: value})), field
    assert not worker_start.plain_context("{not json")


def test_a_forked_worker_has_the_starters_streams_environment_folder_and_status(server, tmp_path):
    path, proc = server
    starter, out, log = _starter(tmp_path, path, "--x=1")
    assert starter.wait(timeout=60) == 3  # the worker's own exit status
    got = json.loads(out.read_text())
    assert got["ppid"] == proc.pid and got["pid"] not in (starter.pid, proc.pid)  # forked by the server
    assert got["pgid"] == got["pid"]  # a process group of its own, as the raylet gives each worker
    assert got["cwd"] == str(tmp_path) and got["name"] == "__main__"
    assert got["argv"] == [str(tmp_path / "default_worker.py"), "--out", str(out), "--x=1"]  # Ray's flags taken off
    assert got["mine"] == "yes" and got["servers"] is None  # the starter's environment, not the server's
    text = log.read_text()
    assert "hello from the worker" in text and "and its stderr" in text  # the starter's stdout and stderr
    assert not (tmp_path / "stub.json").exists()


def test_the_starters_death_ends_the_worker_and_a_signal_reaches_it(server, tmp_path):
    path, _ = server
    starter, out, _ = _starter(tmp_path, path, "--stay")
    worker = _wait_for(lambda: out.exists() and json.loads(out.read_text())["pid"])
    starter.send_signal(signal.SIGTERM)  # forwarded: the worker's handler runs and exits 7
    assert starter.wait(timeout=30) == 7
    assert (tmp_path / "worker.json.term").read_text() == "term"

    out.unlink()
    starter, out, _ = _starter(tmp_path, path, "--stay")
    worker = _wait_for(lambda: out.exists() and json.loads(out.read_text())["pid"])
    starter.kill()  # SIGKILL cannot be forwarded: the worker sees its end of the socket close
    starter.wait(timeout=10)
    _wait_for(lambda: _ended(worker), 10)


def test_a_signal_before_the_server_answers_reaches_the_worker_once_it_is_known(tmp_path):
    """The raylet may end a worker that is still starting: a signal that reaches the starter while its
    request waits for an answer goes to the worker once the answer names it (here the test is the server,
    and a ``sleep`` process stands in for the forked worker)."""
    import socket

    path = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(30)
    starter, _, _ = _starter(tmp_path, path, "--stay")
    conn, _ = listener.accept()
    time.sleep(0.5)  # the request is sent; the starter waits for its answer
    starter.send_signal(signal.SIGTERM)
    stand_in = subprocess.Popen(["sleep", "60"])
    try:
        conn.sendall(b"P" + stand_in.pid.to_bytes(4, "big"))
        assert stand_in.wait(timeout=10) == -signal.SIGTERM
    finally:
        stand_in.kill()
    conn.close()  # the "worker" is gone without saying how
    assert starter.wait(timeout=10) == 1
    listener.close()


def test_without_a_server_or_with_a_runtime_environment_rays_own_setup_runs(server, tmp_path):
    path, _ = server
    for socket_path, context in ((None, None), (str(tmp_path / "nobody-listens"), None), (path, '{"env_vars": {"A": "1"}}')):
        (tmp_path / "stub.json").unlink(missing_ok=True)
        starter, out, _ = _starter(tmp_path, socket_path, "--x=1", context=context)
        assert starter.wait(timeout=60) == 0, (socket_path, context)
        stub = json.loads((tmp_path / "stub.json").read_text())
        flags = [f"--serialized-runtime-env-context={context}"] if context else []
        assert stub["stub_argv"] == [str(tmp_path / "default_worker.py"), "--out", str(out), "--x=1", *flags,
                                     "--language=PYTHON"]  # every argument, unchanged
        assert stub["pid"] == starter.pid  # exec'd in the starter's process, as Ray's chain does
        assert not out.exists()


def test_the_server_runs_only_its_worker_script_for_its_own_user_and_drops_a_silent_peer(server, tmp_path):
    """A peer that connects and says nothing is dropped after a few seconds (the next worker still
    starts: before, it waited behind the silent one for good); a script other than the one worker script
    is declined (the worker starts as Ray starts it); a peer's uid is read from the socket itself."""
    import socket as sockets

    path, _ = server
    silent = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    silent.connect(path)  # and never sends
    try:
        starter, out, _ = _starter(tmp_path, path, "--x=1")
        assert starter.wait(timeout=60) == 3 and json.loads(out.read_text())["argv"][-1] == "--x=1"
    finally:
        silent.close()
    (tmp_path / "stub.json").unlink(missing_ok=True)
    (tmp_path / "worker.json").unlink()
    other = tmp_path / "elsewhere"
    starter, out, _ = _starter(tmp_path, path, "--x=1", script_dir=other)
    assert starter.wait(timeout=60) == 0
    assert json.loads((tmp_path / "stub.json").read_text())["stub_argv"][0] == str(other / "default_worker.py")
    assert not out.exists()  # not forked: Ray's own setup ran it
    a, b = sockets.socketpair(sockets.AF_UNIX, sockets.SOCK_STREAM)
    with a, b:
        assert fork_server.peer_uid(a) == os.getuid()
    assert not fork_server.ray_worker_script([str(other / "default_worker.py")])


CUDA_UP = """
import torch
torch.cuda.is_initialized = lambda: True  # (as after a CUDA call in an import; no GPU needed to say so)
"""


@pytest.mark.parametrize("loaded", ["ray", "cuda_up"])
def test_a_server_with_rays_core_or_cuda_up_declines_and_the_worker_starts_as_ray_starts_it(tmp_path, loaded):
    path = str(tmp_path / "forks" / "s")
    os.makedirs(os.path.dirname(path))
    (tmp_path / "cuda_up.py").write_text(CUDA_UP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "fedsweep.orchestrator.runtime.fork_server", path, str(os.getpid()),
                             loaded], cwd=ROOT, env=env)
    try:
        _wait_for(lambda: os.path.exists(os.path.join(os.path.dirname(path), "ready")), 60)
        starter, out, _ = _starter(tmp_path, path, "--x=1")
        assert starter.wait(timeout=60) == 0
        assert json.loads((tmp_path / "stub.json").read_text())["pid"] == starter.pid
        assert not out.exists()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


DRIVER = r'''
import os, sys, time
from fedsweep.orchestrator.runtime import fork_server
os.environ[fork_server.SWITCH_ENV] = "1"
path = fork_server.start(modules=("json",))
print(path, fork_server.server_pid(), flush=True)
while fork_server.ready_at() is None:
    time.sleep(0.05)
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
'''


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_the_server_ends_with_its_driver_and_leaves_no_socket(tmp_path, end):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), "1.0", end], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    path, pid = driver.stdout.readline().split()
    assert driver.stdout.readline().strip() == "ready" and os.path.exists(path)
    driver.wait(timeout=30)
    _wait_for(lambda: _ended(int(pid)), 10)
    _wait_for(lambda: not os.path.exists(os.path.dirname(path)), 10)


def test_the_switch_decides_and_the_default_is_on_only_without_a_gpu(monkeypatch, tmp_path):
    linux = sys.platform.startswith("linux")
    for gpu in (False, True):  # a device node of a GPU, or none
        monkeypatch.setattr(fork_server, "GPU_DEVICES", (str(tmp_path / "nvidia0"),))
        if gpu:
            (tmp_path / "nvidia0").touch()
        for value, on in (("0", False), ("off", False), ("maybe", False), ("1", True), ("on", True), ("yes", True),
                          ("", not gpu)):
            monkeypatch.setenv(fork_server.SWITCH_ENV, value)
            assert fork_server.enabled() == (on and linux), (value, gpu)
        monkeypatch.delenv(fork_server.SWITCH_ENV)
        assert fork_server.enabled() == (linux and not gpu), gpu


def test_the_server_has_a_session_of_its_own_unless_told_not_to(monkeypatch):
    for value, own in (("", True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv(fork_server.SESSION_ENV, value)
        assert fork_server.own_session() is own, value
    monkeypatch.delenv(fork_server.SESSION_ENV)
    assert fork_server.own_session() is True


def _bench(tmp_path: Path, forks: str) -> tuple[dict, dict]:
    from fedsweep.reproduce.bitwise import digests

    out = tmp_path / forks
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", fork_server.SOCKET_ENV)}
    env[fork_server.SWITCH_ENV] = forks
    done = subprocess.run([sys.executable, "-m", "fedsweep.cli", "bench", "run", "configs/experiments/smoke.yaml",
                           "--set", "tracking.enabled=false", "--set", "rounds=2", "--set", f"checkpoint.dir={out / 'runs'}",
                           "--out", str(out / "bench.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rounds = sorted((out / "runs").glob("*/*/checkpoints/round_*"))
    return json.loads((out / "bench.json").read_text()), digests(rounds[-1])


def test_a_run_with_forked_workers_leaves_the_checkpoint_of_one_without(tmp_path):
    forked, forked_digests = _bench(tmp_path, "1")
    fresh, fresh_digests = _bench(tmp_path, "0")
    assert forked["worker_forks"]["on"] and forked["worker_forks"]["forked"].count("ray::ClientActor") == 2
    assert not fresh["worker_forks"]["on"] and fresh["worker_forks"]["forked"] == []
    when = forked["worker_forks"]  # the server starts before its imports are done, and both after this process
    assert 0 < when["server_started_after_process_start_s"] < when["server_ready_after_process_start_s"]
    assert fresh["worker_forks"]["server_started_after_process_start_s"] is None
    assert any(".safetensors:" in k for k in forked_digests)
    assert forked_digests == fresh_digests
    assert forked["final_train_loss"] == fresh["final_train_loss"]


THREADS = r'''
import json, os
from fedsweep.orchestrator.runtime import fork_server, ray_runtime
ray_runtime.ensure(0, log_to_driver=False)
import ray

class Probe:
    def threads(self):
        import gc

        import torch
        return [os.getppid(), torch.get_num_threads(), torch.get_num_interop_threads(), os.environ.get("OMP_NUM_THREADS"),
                gc.isenabled(), list(gc.get_threshold()), os.getsid(0)]

out = {}
for name, options in (("one_cpu", {"num_cpus": 1}), ("two_cpus", {"num_cpus": 2}), ("a_fraction", {"num_cpus": 0.5}),
                      ("threaded", {"num_cpus": 1, "max_concurrency": 2})):
    actor = ray.remote(**options)(Probe).remote()
    out[name] = ray.get([actor.threads.remote() for _ in range(2)], timeout=120)
out["server"] = fork_server.server_pid()
out["sessions"] = [os.getsid(0), os.getsid(out["server"]) if out["server"] else None]
ray.shutdown()
print("RESULT " + json.dumps(out))
'''


def test_a_forked_workers_torch_has_the_threads_a_fresh_one_reads():
    """Torch fixes its thread count from ``OMP_NUM_THREADS`` as it loads, and Ray sets that variable as a
    worker runs its first task: a forked worker (torch loaded in the server, with the server's cores) has
    the threads a fresh worker has, for actors of one CPU, two, a fraction and a threaded one; and the
    cyclic collector on with the same thresholds (the server imports with it off); and it runs in the
    server's session (a scheduling group of its own), where a fresh one runs in the driver's."""
    got = {}
    for forks in ("1", "0"):
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", fork_server.SOCKET_ENV, "OMP_NUM_THREADS")}
        env[fork_server.SWITCH_ENV] = forks
        done = subprocess.run([sys.executable, "-c", THREADS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        line = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        assert line, done.stdout[-2000:] + done.stderr[-3000:]
        got[forks] = json.loads(line[0][len("RESULT "):])
    forked, fresh = got["1"], got["0"]
    assert forked["server"] and fresh["server"] is None
    for name in ("one_cpu", "two_cpus", "a_fraction", "threaded"):
        assert all(ppid == forked["server"] for ppid, *_ in forked[name]), name  # forked by the server
        assert [t[1:-1] for t in forked[name]] == [t[1:-1] for t in fresh[name]], (name, forked[name], fresh[name])
        # a forked worker is in the server's session (a scheduling group of its own), a fresh one in the driver's
        assert all(t[-1] == forked["sessions"][1] != forked["sessions"][0] for t in forked[name]), (name, forked)
        assert all(t[-1] == fresh["sessions"][0] for t in fresh[name]), (name, fresh)
    assert all(t[4] is True for t in forked["one_cpu"])  # the collector is on in a forked worker, as in a fresh one
    assert fresh["two_cpus"][0][1] == 2 and fresh["two_cpus"][0][3] == "2"  # Ray's value, as torch read it
    assert fresh["one_cpu"][0][1] == 1  # (Ray's 1 for one CPU: where the server's own count, its cores, differs)


def test_a_sigterm_in_the_middle_of_the_imports_ends_the_server_at_once_without_a_traceback(tmp_path):
    """The server asked to stop while it imports (a refused config's driver stops it at once): it ends within
    a second, status 0, nothing on its stderr (a ``SystemExit`` raised into an import printed an
    ``Exception ignored`` traceback beside the config's one line), its socket removed."""
    path = str(tmp_path / "forks" / "s")
    os.makedirs(os.path.dirname(path))
    proc = subprocess.Popen([sys.executable, "-m", "fedsweep.orchestrator.runtime.fork_server", path, str(os.getpid()),
                             "torch", "transformers.models.llama.modeling_llama", "peft"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: os.path.exists(path))  # bound: the imports under way
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.terminate()
    _, err = proc.communicate(timeout=10)
    assert time.monotonic() - t0 < 1.5 and proc.returncode == 0
    assert err.strip() == "" and not os.path.exists(path)
