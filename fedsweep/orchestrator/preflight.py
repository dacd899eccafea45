"""What a command hands :func:`fedsweep.orchestrator.ray_runtime.start_while`: its config's loading,
with every import that loading needs (pydantic, the methods, torch through their tensor code) made
inside the function, so in the thread that validates while Ray starts, not in the main thread before
Ray's start. This module imports nothing heavy itself: taking a function from it costs the main
thread nothing (importing ``fedsweep.config`` there used to cost it torch's import, 1.6-2.8 s on the
2-core VM, before Ray's processes were even spawned).

A config that tracks also has its MLflow store prepared (MLflow's import, SQLAlchemy's, the schema
check) in a thread of its own, begun once the config is valid: Ray's start leaves a core mostly
idle, and ``tracking.prepare_store`` in the run's own tracking thread, which used to pay for it
beside the actors' imports, takes the finished preparation (:func:`store_prepared`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsweep.config import ExperimentConfig

_LOCK = threading.Lock()
_STORES: dict[str, Future] = {}  # tracking stores being prepared, by URI, until the run takes them


def load_experiment(path: str, overrides: list[str]) -> "ExperimentConfig":
    """:func:`fedsweep.config.load_config` (``fedsweep run``, ``fedsweep bench run``); a config that
    tracks has its store prepared in a thread of its own (:func:`prepare_store_soon`)."""
    from fedsweep.config import load_config

    cfg = load_config(path, overrides)
    if cfg.tracking.enabled:
        prepare_store_soon(cfg.tracking.uri)
    return cfg


def load_study(path: str, overrides: list[str]) -> tuple[Any, Any]:
    """:func:`fedsweep.config.sweep.load_sweep` (``fedsweep tune``), and its store prepared in a thread
    (a study's driver always tracks)."""
    from fedsweep.config.sweep import load_sweep

    sweep, base = load_sweep(path, overrides)
    prepare_store_soon(sweep.tracking_uri)
    return sweep, base


def prepare_store_soon(uri: str) -> None:
    """MLflow's import and the store's schema check (``tracking.prepare_store``: 2.3 CPU-seconds on the
    2-core VM) begun now, in a thread, on the core Ray's start leaves idle, instead of later beside the
    actors' imports; ``tracking.prepare_store`` takes the result (:func:`store_prepared`).

    The thread imports MLflow through ``fedsweep.orchestrator.tracking``, and so must every other
    import of MLflow in fedsweep (``tests/test_contract.py`` checks): a second thread importing that
    module waits on its module lock until the first is done, whereas two threads inside MLflow's own
    circular imports at once can meet a module half-initialised (``fedsweep tune`` did, importing
    ``mlflow.tracking`` directly)."""
    def prepare() -> None:
        from fedsweep.orchestrator.tracking import create_store

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
