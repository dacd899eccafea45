"""The one place that starts or joins a Ray runtime for a run or a study.

A local runtime (no ``RAY_ADDRESS``) is started for this machine alone:

* every Ray server (GCS, raylet, object manager, workers, dashboard and runtime-env agents)
  listens on 127.0.0.1 only — Ray binds its servers to loopback when its node IP is the
  loopback address, which ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` selects on Linux too
  (measured with ``ss -ltnp``: 0 of its listening sockets on other addresses, 13 of 14 without);
* Ray's token authentication is off only where the user has not chosen (``RAY_AUTH_MODE`` is
  set to ``disabled`` only when unset; a local runtime on loopback has no remote peers);
* a watchdog process outlives the driver by at most a second: if the driver dies without
  shutting Ray down (killed, crashed), it ends every process of the runtime it started;
* it has the machine's cores plus one logical CPU (``COORDINATION_CPUS``) for the server and trial
  drivers, which wait on the client actors nearly all the time, so that the automatic layout puts
  one client actor on every core;
* the autoscaler monitor, which a single machine has no use for, is not started: that alone makes
  ``ray.shutdown`` 0.8-1.0 s shorter here (measured over 5 starts; every other ``ray.init`` option
  tried — a smaller object store, no log forwarding, no usage stats — changed nothing beyond noise);
* nor is the dashboard's API server, which ``include_dashboard=False`` still starts (with only its
  usage-stats module) and ``ray.init`` waits on: ``ray.init`` took 3.4-4.5 s without it against
  5.8-6.0 s with it (2 starts each, this 2-core VM), and one Python process less competes for the
  cores while the actors import. Nothing of a local run uses it (no job submission, no state API);
* the dashboard agent runs ``--minimal`` (as it does where Ray is installed without its dashboard
  extras): no HTTP server, job, log or metrics modules, and the driver does not import aiohttp to
  decide that (0.4 s);
* where the workers' output is not forwarded to the driver (``log_to_driver=False``: a study's
  progress view, the test sessions), no log monitor either: forwarding is its only use;
* ``ray.init`` learns that the raylet has registered by asking the GCS every 50 ms, not once a second
  (the raylet registers 1.2-1.4 s after it starts here, waiting for its agents, so Ray's own wait lost
  most of a second). With the two items above: ``ray.init`` 2.1-2.3 s against 2.8-3.4 s.

:func:`start_while` starts the runtime while the driver validates the config in a thread (one core
imports and validates, the other starts Ray's processes); :func:`ensure` then takes it.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ensure(num_cpus: float, log_to_driver: bool = True) -> bool:
    """Join ``RAY_ADDRESS`` or start a loopback-only local runtime; True if started here.
    ``log_to_driver``: print the workers' output here (off under a progress view: it stays in
    Ray's session logs)."""
    import ray

    from fedsweep.env import LOCAL_RUNTIME_ENV, apply_defaults, worker_env

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
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ[LOOPBACK_ENV] = "0"  # for the processes Ray starts
    # Ray's workers inherit this environment: actors then need no runtime_env of their own, and so
    # run in the workers Ray starts ahead of time instead of fresh dedicated processes
    os.environ.update(worker_env())
    os.environ[LOCAL_RUNTIME_ENV] = "1"
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


@contextlib.contextmanager
def _lean_local_node(log_monitor: bool = True):
    """``ray.init`` of a local node without the autoscaler monitor process (Ray's node parameters have a
    ``no_monitor`` switch that ``ray.init`` does not expose), without the dashboard's API server
    (started even with ``include_dashboard=False``), with a minimal dashboard agent, and with a wait for
    the raylet's registration that asks every 50 ms (:func:`_wait_registered`). ``log_monitor=False``
    (the workers' output is not forwarded to the driver): without the log monitor either, whose only
    reader is that forwarding; it re-reads every worker's log files about once a second, and so costs
    more the longer the runtime lives (48 CPU-seconds over the test suite's runtimes, of 1,784 in all).
    Left alone where Ray's internals differ."""
    try:
        from ray._private import node, parameter, services, utils

        original_params, original_api = parameter.RayParams.__init__, node.Node.start_api_server
        original_deps, original_get_node = utils.get_dashboard_dependency_error, services.get_node
    except (ImportError, AttributeError):
        yield
        return

    def init(self, *args, **kwargs):
        original_params(self, *args, **kwargs)
        if hasattr(self, "no_monitor"):
            self.no_monitor = True
        if not log_monitor and hasattr(self, "include_log_monitor"):
            self.include_log_monitor = False

    def no_api_server(self, *args, **kwargs):
        self._webui_url = None

    def minimal_agent():
        return ImportError("fedsweep: the local runtime's dashboard agent runs minimal")

    def get_node_when_registered(gcs_address, node_id):
        _wait_registered(gcs_address, node_id)
        return original_get_node(gcs_address, node_id)

    parameter.RayParams.__init__ = init
    node.Node.start_api_server = no_api_server
    utils.get_dashboard_dependency_error = minimal_agent
    services.get_node = get_node_when_registered
    try:
        yield
    finally:
        parameter.RayParams.__init__ = original_params
        node.Node.start_api_server = original_api
        utils.get_dashboard_dependency_error = original_deps
        services.get_node = original_get_node


def _wait_registered(gcs_address: str, node_id: str, timeout_s: float = 30.0, every_s: float = 0.05) -> None:
    """Poll the GCS's node table until ``node_id`` is alive there (or ``timeout_s`` passes). Ray's own wait
    asks once and then sleeps a whole second between asks: the raylet registers 1.2-1.4 s after it starts
    here (it waits for its agents), so ``ray.init`` used to lose most of a second doing nothing."""
    import time

    from ray._private import services, state

    global_state = state.GlobalState()
    deadline = time.monotonic() + timeout_s
    try:
        global_state._initialize_global_state(services._get_gcs_client_options(gcs_address))
        while time.monotonic() < deadline:
            if any(n.get("NodeID") == node_id and n.get("Alive") for n in global_state.node_table()):
                return
            time.sleep(every_s)
    except Exception:  # noqa: BLE001  (Ray's own wait, which follows, reports what is wrong)
        return
    finally:
        global_state.disconnect()


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
