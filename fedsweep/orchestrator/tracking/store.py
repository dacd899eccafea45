"""MLflow stores prepared ahead, in a thread, while Ray starts: what ``preflight`` begins and
``tracker.prepare_store`` takes. Light: MLflow is imported in the thread, through ``mlflow_api``."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

_LOCK = threading.Lock()
_STORES: dict[str, Future] = {}  # tracking stores being prepared, by URI, until the run takes them


def prepare_store_soon(uri: str) -> None:
    """MLflow's import and the store's schema check (``tracker.prepare_store``: seconds of CPU) begun now, in a thread, on the core Ray's start leaves idle, instead of later beside the
    actors' imports; ``tracker.prepare_store`` takes the result (:func:`store_prepared`).

    The thread imports MLflow through ``fedsweep.orchestrator.tracking.tracker``, and so must every other
    import of MLflow in fedsweep (``tests/test_contract.py`` checks): a second thread importing that
    module waits on its module lock until the first is done, whereas two threads inside MLflow's own
    circular imports at once can meet a module half-initialised (``fedsweep tune`` did, importing
    ``mlflow.tracking`` directly)."""
    def prepare() -> None:
        from fedsweep.orchestrator.tracking.mlflow_api import create_store

        create_store(uri)

    with _LOCK:
        if uri in _STORES:  # one preparation of a store at a time (sqlite's schema creation races)
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedsweep-store")
        _STORES[uri] = pool.submit(prepare)
        pool.shutdown(wait=False)


def store_prepared(uri: str) -> bool:
    """Wait for a preparation of ``uri`` begun by :func:`prepare_store_soon`: True if one was begun and
    succeeded, taken once (a failed one is left for the caller to repeat, and report)."""
    with _LOCK:
        future = _STORES.pop(uri, None)
    if future is None:
        return False
    try:
        future.result()
    except Exception:  # noqa: BLE001  (repeated, and reported, by the caller)
        return False
    return True
