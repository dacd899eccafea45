"""The one place that starts or joins a Ray runtime for a run or a study.

A local runtime (no ``RAY_ADDRESS``) is started for this machine alone:

* every Ray server (GCS, raylet, object manager, workers, dashboard and runtime-env agents)
  listens on 127.0.0.1 only — Ray binds its servers to loopback when its node IP is the
  loopback address, which ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects on Linux too
  (``ss -ltnp`` shows none of its listening sockets on another address);
* Ray's token authentication is off only where the user has not chosen (``RAY_AUTH_MODE`` is
  set to ``disabled`` only when unset; a local runtime on loopback has no remote peers);
* a watchdog process outlives the driver by at most a second: if the driver dies without
  shutting Ray down (killed, crashed), it ends every process of the runtime it started;
* it has the machine's cores plus one logical CPU (``COORDINATION_CPUS``) for the server and trial
  drivers, which wait on the client actors nearly all the time, so that the automatic layout puts
  one client actor on every core;
* the autoscaler monitor, which a single machine has no use for, is not started (``ray.shutdown`` is
  shorter for it);
* nor is the dashboard's API server, which ``include_dashboard=False`` still starts (with only its
  usage-stats module) and ``ray.init`` waits on: one Python process less competes for the cores while
  the actors import. Nothing of a local run uses it (no job submission, no state API);
* the dashboard agent runs ``--minimal`` (as it does where Ray is installed without its dashboard
  extras): no HTTP server, job, log or metrics modules, and the driver does not import aiohttp to
  decide that;
* where the workers' output is not forwarded to the driver (``log_to_driver=False``: a study's
  progress view, the test sessions), no log monitor either: forwarding is its only use;
* a process of the runtime that finds a Unix socket not yet there (the raylet's object manager
  connecting to its object store) tries again after 50 ms, not after a whole second
  (``local_node.SOCKET_RETRY_ENV``);
* ``ray.init`` learns that the raylet has registered by asking the GCS every 50 ms, not once a second
  (the raylet registers a second or more after it starts, waiting for its agents, so Ray's own wait
  lost most of a second). What each of these saves: docs/performance.md, 'The design's measurements';
* its Python workers are forked from a process that imports torch, transformers and peft while Ray
  starts (:mod:`~fedsweep.orchestrator.runtime.fork_server`, started before the driver imports Ray;
  so none is started ahead of the actors, which ``ray.init`` would wait for): on Linux by default
  where the machine has no GPU, and as ``FEDSWEEP_WORKER_FORKS`` says where it is set.
  These switches live in :mod:`~fedsweep.orchestrator.runtime.local_node`.

:func:`start_while` starts the runtime while the driver validates the config in a thread (one core
imports and validates, the other starts Ray's processes); :func:`ensure` then takes it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from fedsweep.orchestrator.runtime import fork_server
from fedsweep.orchestrator.runtime.local_node import lean_local_node as _lean_local_node

T = TypeVar("T")

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ensure(num_cpus: float, log_to_driver: bool = True) -> bool:
    """Join ``RAY_ADDRESS`` or start a loopback-only local runtime; True if started here.
    ``log_to_driver``: print the workers' output here (off under a progress view: it stays in
    Ray's session logs)."""
    _fork_server_first()
    import ray

    from fedsweep.env import apply_defaults

    global _STARTED_EARLY
    started, _STARTED_EARLY = _STARTED_EARLY, None
    if started and ray.is_initialized():  # start_while started it
        if os.environ.get("RAY_ADDRESS") or ray.cluster_resources().get("CPU", 0.0) >= local_cpus(num_cpus):
            return True
        ray.shutdown()  # an explicit layout asks more logical CPUs than it has
    if ray.is_initialized():
        return False
    apply_defaults()
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING", log_to_driver=log_to_driver)
        return True
    _local_environment()
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # for this one, which read the variable when ray was imported
    for attempt in range(START_ATTEMPTS):
        try:
            with _lean_local_node(log_monitor=log_to_driver):
                ray.init(address="local", num_cpus=local_cpus(num_cpus), include_dashboard=False,
                         logging_level="WARNING", configure_logging=True, log_to_driver=log_to_driver)  # never attach to a stray local cluster
            break
        except Exception as exc:  # noqa: BLE001  (Ray raises a bare Exception for it)
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS - 1:
                raise
            ray.shutdown()  # the half-started node's processes, then again: a loaded machine's raylet
            time.sleep(2.0)  # can miss Ray's fixed 30 s to register (another run beside this one)
    start_watchdog()
    return True


def _local_environment() -> None:
    """The environment a local runtime's processes inherit (Ray's, the fork server's): Ray's workers
    get :func:`~fedsweep.env.worker_env` this way, so actors need no runtime_env of their own and run
    in the workers Ray starts instead of fresh dedicated processes."""
    from fedsweep.env import LOCAL_RUNTIME_ENV, worker_env

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ[LOOPBACK_ENV] = "0"  # for the processes Ray starts
    os.environ.update(worker_env())
    os.environ[LOCAL_RUNTIME_ENV] = "1"


def _fork_server_first() -> None:
    """Where a local runtime is about to start (no ``RAY_ADDRESS``, Ray not up here), its environment
    set and the fork server started before this process imports Ray, so that the server's
    imports, the set-up's longest part, begin at once; the local node takes the running server
    (:func:`fork_server.start` is idempotent)."""
    from fedsweep.env import apply_defaults

    ray = sys.modules.get("ray")
    if not fork_server.enabled() or (ray is not None and ray.is_initialized()):
        return
    apply_defaults()
    if os.environ.get("RAY_ADDRESS"):
        return
    _local_environment()
    fork_server.start()


START_ATTEMPTS = 3
"""How often a local runtime is started before its start's failure is the user's: Ray gives its raylet a
fixed 30 s to register with the GCS, which a machine busy with another run can miss."""


COORDINATION_CPUS = 1


def local_cpus(asked: float = 0.0) -> int:
    """Logical CPUs of a local runtime: the cores plus ``COORDINATION_CPUS``, or what an explicit layout asks."""
    return max((os.cpu_count() or 1) + COORDINATION_CPUS, math.ceil(asked))


_STARTED_EARLY: bool | None = None  # what the runtime start of :func:`start_while` returned, for ensure


def start_while(fn: Callable[..., T], *args, log_to_driver: bool = True) -> T:
    """``fn(*args)`` (the config's validation) in a thread while this thread starts the runtime
    :func:`ensure` would start (Ray's processes start on one core while the other validates); the next
    :func:`ensure` takes that runtime (and starts it again, larger, if the config asks more logical
    CPUs). ``fn``'s error wins over Ray's, and stops the runtime started here. Ray's start stays in
    this thread: the processes it spawns die with the thread that spawned them."""
    global _STARTED_EARLY
    _fork_server_first()
    import ray

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedsweep-config")
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    started, failure = False, None
    try:
        started = ensure(0.0, log_to_driver)
    except Exception as exc:
        failure = exc
    try:
        result = future.result()
    except BaseException:
        if started:
            ray.shutdown()
        raise
    if failure is not None:
        raise failure
    _STARTED_EARLY = started
    return result


def runtime_pids() -> list[int]:
    """PIDs of the processes this driver's local runtime started (GCS, raylet, log monitor, …)."""
    import ray

    node = ray._private.worker._global_node
    if node is None:
        return []
    return [p.process.pid for procs in node.all_processes.values() for p in procs if p.process is not None]


def start_watchdog() -> subprocess.Popen | None:
    pids = runtime_pids()
    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-m", "fedsweep.orchestrator.runtime.watchdog", str(os.getpid()), *map(str, pids)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
