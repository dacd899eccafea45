"""The local node a run starts: Ray's processes, fewer and started sooner than ``ray.init`` alone starts them.

What it leaves out and why, with the measurements, is in :mod:`~fedsweep.orchestrator.runtime.ray_runtime`'s
docstring; how the Python workers start, in :mod:`~fedsweep.orchestrator.runtime.fork_server`. Nothing here
moves a computed value: it decides which processes exist and when they start.
"""

from __future__ import annotations

import contextlib
import os

from fedsweep.orchestrator.runtime import fork_server

SOCKET_RETRY_ENV = {"RAY_raylet_client_connect_timeout_milliseconds": "50",
                    "RAY_raylet_client_num_connect_attempts": "200"}
"""How a local runtime's processes retry a Unix socket that is not there yet: every 50 ms, for the 10 s
Ray allows (Ray: every 1,000 ms, 10 times). The raylet's object manager connects to the object store
the raylet has just started; where the store's socket was not yet up, Ray's first retry came a whole
second later, and the start waited that second (docs/performance.md, 'The design's measurements'). The setting is only a sleep between attempts (Ray's
``ConnectSocketRetry``, and its workers' asking the raylet for the system config), so a shorter one with
more attempts waits as long in all. A variable the user set is kept."""

WORKER_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_start.py")
"""The script the raylet runs to start a Python worker (in place of Ray's ``setup_worker.py``)."""


@contextlib.contextmanager
def lean_local_node(log_monitor: bool = True):
    """``ray.init`` of a local node without the autoscaler monitor process (Ray's node parameters have a
    ``no_monitor`` switch that ``ray.init`` does not expose), without the dashboard's API server
    (started even with ``include_dashboard=False``), with a minimal dashboard agent, and with a wait for
    the raylet's registration that asks every 50 ms (:func:`wait_registered`). ``log_monitor=False``
    (the workers' output is not forwarded to the driver): without the log monitor either, whose only
    reader is that forwarding; it re-reads every worker's log files about once a second, and so costs
    more the longer the runtime lives (48 CPU-seconds over the test suite's runtimes, of 1,784 in all).
    A missing Unix socket is retried every 50 ms (:data:`SOCKET_RETRY_ENV`). Python workers start
    through :mod:`~fedsweep.orchestrator.runtime.worker_start`, forked from the fork
    server where :func:`fork_server.enabled` (started here). Left alone where Ray's internals differ."""
    try:
        from ray._private import node, parameter, ray_constants, services, utils

        ray_setup = os.path.join(os.path.dirname(node.__file__), "workers", ray_constants.SETUP_WORKER_FILENAME)
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
        if forks and getattr(self, "setup_worker_path", "") is None:  # (a path set by the caller is kept)
            self.setup_worker_path = WORKER_START
            # ray.init waits for the workers Ray starts ahead of time to register: forked ones come once
            # the fork server has imported (seconds), so none are started ahead; the actors' come at once
            self._system_config = {"prestart_worker_first_driver": False, **(self._system_config or {})}

    def no_api_server(self, *args, **kwargs):
        self._webui_url = None

    def minimal_agent():
        return ImportError("fedsweep: the local runtime's dashboard agent runs minimal")

    def get_node_when_registered(gcs_address, node_id):
        wait_registered(gcs_address, node_id)
        return original_get_node(gcs_address, node_id)

    for name, value in SOCKET_RETRY_ENV.items():  # read by every process Ray starts, which inherit it
        os.environ.setdefault(name, value)
    forks = os.path.isfile(ray_setup) and fork_server.start() is not None
    if forks:
        os.environ[fork_server.RAY_SETUP_ENV] = ray_setup  # what worker_start execs where it does not fork
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


def wait_registered(gcs_address: str, node_id: str, timeout_s: float = 30.0, every_s: float = 0.05) -> None:
    """Poll the GCS's node table until ``node_id`` is alive there (or ``timeout_s`` passes). Ray's own wait
    asks once and then sleeps a whole second between asks: the raylet registers a second or more after it
    starts (it waits for its agents), so ``ray.init`` used to lose most of a second doing nothing."""
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
