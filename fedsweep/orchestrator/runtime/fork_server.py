"""Ray's Python workers of a local runtime, forked from one process that has already imported what
a client actor imports, so that those imports overlap Ray's start instead of following it.

Without it a worker is ``python setup_worker.py`` (Ray's, importing part of Ray), which execs ``bash``,
which execs ``python default_worker.py`` (importing Ray again); the client actor created in it then
imports torch, transformers' Llama modules and peft, the set-up's longest part, in sequence after
Ray's start, before any client trains (docs/performance.md, 'The design's measurements').

With it (Linux, a local runtime fedsweep starts; by default where the machine has no GPU, and
``FEDSWEEP_WORKER_FORKS`` decides either way: :func:`enabled`):

* :func:`start` spawns the *fork server* as the runtime starts: a process with the workers'
  environment, in a session of its own (:func:`own_session`), that binds a Unix socket at once, imports
  :data:`WARM_MODULES` with the cyclic collector off (on the core Ray's start leaves free) and then
  answers requests, one ``fork()`` each;
* Ray's raylet starts each Python worker through :mod:`~fedsweep.orchestrator.runtime.worker_start`
  (the ``setup_worker_path`` that :mod:`~fedsweep.orchestrator.runtime.local_node` gives the local
  node) which, where the worker has no runtime environment of its own, hands its command line,
  environment, working directory and standard streams to the server and stays as the raylet's
  process for that worker: a signal it gets goes to the worker, and it exits with the worker's
  status; either one's death ends the other (they hold the two ends of one socket);
* the forked child takes the streams, the environment and the folder, and runs Ray's
  ``default_worker.py`` as ``__main__``, as the exec'd interpreter would have.

A forked worker computes what a fresh one computes: nothing is drawn from a random stream before the
fork; Ray's core is imported after it (it reads the worker's environment as it loads); torch gets the
thread count it would have read as it loaded (:func:`_take_environment`); and the recovery tests'
bitwise checks and ``tests/test_fork_server.py``'s run-against-run comparison hold with it on. Where anything is
unusual (a runtime environment, another language, the server gone or not single-threaded) the worker
starts as Ray starts it.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from fedsweep.orchestrator.runtime.worker_start import RAY_SETUP_ENV, SOCKET_ENV  # (the starter's names, kept there)

SWITCH_ENV = "FEDSWEEP_WORKER_FORKS"
"""``1`` (or ``on``, ``true``, ``yes``): workers are forked; any other value set: they start as Ray starts
them; unset or empty: :func:`enabled`'s default (forked where the machine has no GPU)."""

WARM_MODULES = ("torch", "transformers.models.llama.modeling_llama", "peft", "fedsweep.actors.engine_setup",
                "fedsweep.actors.client_training", "fedsweep.actors.client_eval", "fedsweep.algorithms.registry")
"""What a client actor imports, Ray left out: a worker's Ray (its C++ core) reads the worker's own
environment (its job, among others) once, as it loads, so each worker imports Ray itself after the
fork. A module that fails to import here is left to the worker, which then reports it as it
would have."""

NOT_BEFORE_FORK = "ray._raylet"
"""Where this is loaded in the server, the server declines to fork (see :data:`WARM_MODULES`)."""


def _declines() -> bool:
    """Fork nothing where a worker forked now would not be a fresh one: a thread besides this one (a fork
    copies only the calling thread), Ray's core loaded (:data:`NOT_BEFORE_FORK`), or CUDA initialised by
    torch (a forked child cannot use it)."""
    torch = sys.modules.get("torch")
    cuda = torch is not None and getattr(getattr(torch, "cuda", None), "is_initialized", lambda: False)()
    return threading.active_count() > 1 or NOT_BEFORE_FORK in sys.modules or bool(cuda)


_started: dict[str, object] = {}


GPU_DEVICES = ("/dev/nvidia0", "/dev/kfd")
"""Device nodes of a GPU (NVIDIA's first card; AMD's ROCm driver): where one exists the default is off."""


def enabled() -> bool:
    """Fork workers here: on Linux (``fork`` after these imports is sound there; not on macOS), by
    default where the machine has no GPU (:data:`GPU_DEVICES`): on a GPU node the default waits for a
    first measurement on a device (docs/gpu.md). ``FEDSWEEP_WORKER_FORKS`` decides either way: ``1``,
    ``on``, ``true`` or ``yes`` forks, any other value set does not.

    Off by default everywhere until 2026-11-30: a client actor forked back within a second of being
    killed met a race in the server's adoption of it (a new life that answered a call before it was
    adopted kept what it trained; ``ClientCalls.adopt``, fixed in 1cca057)."""
    if not sys.platform.startswith("linux"):
        return False
    switch = os.environ.get(SWITCH_ENV, "").strip().lower()
    if switch:
        return switch in ("1", "on", "true", "yes")
    return not any(os.path.exists(device) for device in GPU_DEVICES)


SESSION_ENV = "FEDSWEEP_FORK_SESSION"
"""``0``: the fork server (and so its forked workers) stays in the driver's session; anything else or unset:
a session of its own (:func:`own_session`)."""


def own_session() -> bool:
    """Start the server in a session of its own: where Linux's scheduler groups processes by session
    (``/proc/sys/kernel/sched_autogroup_enabled``, on by default on most distributions), its imports, the
    set-up's longest part, then get a core's share of their own instead of one share among the driver's
    and Ray's processes starting beside them (the dashboard and runtime-env agents and the log monitor import
    Ray meanwhile). Its forked workers, and so the client actors, are in that session too, which leaves the
    rounds as they were. Elsewhere (no autogroups, or processes in a cgroup of their own) the session
    changes nothing. Tried first and dropped: Ray's agents and log monitor started nicer than the driver,
    which starved them on a busy machine (docs/performance.md, 'The design's measurements')."""
    return os.environ.get(SESSION_ENV, "").strip() != "0"


def start(modules: tuple[str, ...] = WARM_MODULES) -> str | None:
    """Start the fork server for this driver (once; later runtimes of this process reuse it) and put its
    socket in this process's environment, which the runtime's processes inherit; the socket's path, or
    None where :func:`enabled` says no. Call it with the workers' environment already in place.
    ``modules``: what the server imports (tests give a light list)."""
    if not enabled():
        os.environ.pop(SOCKET_ENV, None)
        return None
    proc = _started.get("proc")
    if proc is not None and proc.poll() is None:
        return str(_started["path"])
    path = os.path.join(tempfile.mkdtemp(prefix="fedsweep-forks-"), "s")
    _started["proc"] = subprocess.Popen([sys.executable, "-m", "fedsweep.orchestrator.runtime.fork_server", path,
                                         str(os.getpid()), *modules], stdin=subprocess.DEVNULL, close_fds=True,
                                        start_new_session=own_session())
    _started["path"] = path
    os.environ[SOCKET_ENV] = path
    if not _started.get("atexit"):
        atexit.register(stop)  # (the server also ends by itself within half a second of this process)
        _started["atexit"] = True
    return path


def server_pid() -> int | None:
    proc = _started.get("proc")
    return proc.pid if proc is not None and proc.poll() is None else None


def stop() -> None:
    """End this driver's fork server (its forked workers live on: they are Ray's)."""
    proc = _started.pop("proc", None)
    path = _started.pop("path", None)
    os.environ.pop(SOCKET_ENV, None)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    if path:
        _remove(str(path))


# --- the server -------------------------------------------------------------------------------------

def serve(path: str, driver_pid: int, modules: tuple[str, ...] = WARM_MODULES) -> None:
    """Bind ``path``, import ``modules``, then fork a worker per request until the driver is gone. Once
    the imports are done, the file ``ready`` beside the socket holds the time (epoch seconds).

    The imports run with Python's cyclic collector off, then one collection and a freeze: otherwise the
    collector walks the growing heap of some 3,000 modules' objects again and again as they load, for
    nothing worth it (docs/performance.md, 'The design's measurements'). A forked worker starts with the collector on, as a fresh one does.
    SIGTERM ends the server at once (its socket removed), wherever it is: a ``SystemExit`` raised inside an
    import would print its traceback and could leave the process to its killer's grace period."""
    def ended(*_):  # end now, without raising into whatever code the signal interrupts (an import's)
        _remove(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, ended)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(64)  # a worker asking while the imports run waits in the backlog
        gc.disable()
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001  (the worker imports it again, and reports it where it is used)
                pass
        gc.collect()
        gc.freeze()  # the imported objects stay out of the forked workers' collections (and their pages shared)
        gc.enable()
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the forked workers are reaped as they end
        _write_ready(path)
        listener.settimeout(0.5)
        while os.getppid() == driver_pid:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(REQUEST_TIMEOUT_S)  # a silent peer cannot stall every worker start behind it
            _answer(conn, listener)
    finally:
        listener.close()
        _remove(path)


def _write_ready(path: str) -> None:
    ready = os.path.join(os.path.dirname(path), "ready")
    with open(ready + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(ready + ".tmp", ready)


def ready_at() -> float | None:
    """When this driver's fork server finished its imports (epoch seconds), or None (not started, not ready)."""
    path = _started.get("path")
    try:
        with open(os.path.join(os.path.dirname(str(path)), "ready")) as f:
            return float(f.read())
    except (OSError, ValueError, TypeError):
        return None


def _remove(path: str) -> None:
    folder = os.path.dirname(path)
    for name in (path, os.path.join(folder, "ready")):
        try:
            os.unlink(name)
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


REQUEST_TIMEOUT_S = 5.0
"""How long the server waits for a request's bytes once a peer connected (a starter sends them at once)."""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


SCRIPT_ENV = "FEDSWEEP_FORK_SCRIPT"
"""The one worker script the server runs, where not Ray's own (a test's stand-in)."""


def ray_worker_script(argv: list[str]) -> bool:
    """Whether ``argv`` starts Ray's own default worker (the one script the server runs; :data:`SCRIPT_ENV`
    names another for a test)."""
    if not argv:
        return False
    expected = os.environ.get(SCRIPT_ENV)
    if not expected:
        import importlib.util

        spec = importlib.util.find_spec("ray")  # (found, not imported: Ray's core loaded here would end the forks)
        if spec is None or not spec.origin:
            return False
        expected = os.path.join(os.path.dirname(spec.origin), "_private", "workers", "default_worker.py")
    return os.path.realpath(str(argv[0])) == os.path.realpath(expected)


def _answer(conn: socket.socket, listener: socket.socket) -> None:
    """One request: ``[4-byte length][JSON {argv, env, cwd}]`` with the three standard streams' descriptors;
    a declined or broken one is answered ``N`` (where it still can be) and its descriptors closed. Only this
    user's processes are served (``SO_PEERCRED``), only Ray's worker script is run, and a request that
    does not arrive within :data:`REQUEST_TIMEOUT_S` is dropped."""
    fds: list[int] = []
    try:
        if peer_uid(conn) != os.getuid():
            raise ConnectionError("another user's process")
        head, fds, _, _ = socket.recv_fds(conn, 4, 3)
        size = int.from_bytes(head, "big")
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ConnectionError("request cut short")
            body += chunk
        request = json.loads(body)
        if len(fds) != 3 or _declines() or not ray_worker_script(request.get("argv") or []):
            conn.sendall(b"N")
            raise ConnectionError("declined")
    except (OSError, ValueError, ConnectionError):
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.settimeout(None)
        _become_worker(conn, fds, request)  # never returns
    for fd in fds:
        os.close(fd)
    conn.close()


def _become_worker(conn: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked child: take the starter's streams, environment and folder, and run Ray's worker."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)  # a process group of its own, as the raylet gives each worker it starts
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        _take_environment(request["env"])
        sys.argv = list(request["argv"])
        conn.sendall(b"P" + os.getpid().to_bytes(4, "big"))
        threading.Thread(target=_exit_when_starter_ends, args=(conn,), name="fedsweep-starter", daemon=True).start()
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (the worker's own error: print it where Ray reads the worker's stderr)
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        try:
            conn.sendall(bytes([code & 0xFF]))
        except OSError:
            pass
        os._exit(code)


THREAD_ENV = "OMP_NUM_THREADS"


def _take_environment(env: dict[str, str]) -> None:
    """The worker's environment in place of the server's, and the thread count torch would have read from
    it. Torch fixes its threads from ``OMP_NUM_THREADS`` as it loads; Ray sets that variable in a worker
    as it runs the worker's first task (to the task's CPUs, or 1), and a fresh worker's actor loads torch
    then. A forked worker loaded torch in the server: when Ray sets the variable there for the first time,
    torch is given the value it would have read (``torch.set_num_threads``, in the task's thread)."""
    os.environ.clear()
    os.environ.update(env)
    if "torch" not in sys.modules:
        return
    import ray._private.utils as ray_utils  # (what default_worker.py imports next, with this environment)

    original, applied = ray_utils.set_omp_num_threads_if_unset, []

    def set_then_follow() -> bool:
        changed = original()
        value = os.environ.get(THREAD_ENV, "")
        if not applied and value.isdigit() and int(value) > 0:
            applied.append(value)
            torch = sys.modules["torch"]
            if torch.get_num_threads() != int(value):
                torch.set_num_threads(int(value))
        return changed

    ray_utils.set_omp_num_threads_if_unset = set_then_follow


def _exit_when_starter_ends(conn: socket.socket) -> None:
    """The raylet's handle on this worker is the starter process: when it ends (killed), so does the worker."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os._exit(1)


if __name__ == "__main__":  # PATH DRIVER_PID [MODULE ...]  (the modules: tests give their own)
    serve(sys.argv[1], int(sys.argv[2]), tuple(sys.argv[3:]) or WARM_MODULES)
