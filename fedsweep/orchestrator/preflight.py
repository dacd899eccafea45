"""What a command hands :func:`fedsweep.orchestrator.ray_runtime.start_while`: its config's loading,
with every import that loading needs (pydantic, the methods, torch through their tensor code) made
inside the function, so in the thread that validates while Ray starts, not in the main thread before
Ray's start. This module imports nothing heavy itself: taking a function from it costs the main
thread nothing (importing ``fedsweep.config`` there used to cost it torch's import, 1.6-2.8 s on the
2-core VM, before Ray's processes were even spawned).

A config that tracks also has its MLflow store prepared there (MLflow's import, SQLAlchemy's, the
schema check): Ray's start leaves a core mostly idle, and the run's own tracking thread, which used to
pay for it beside the actors' imports, takes the finished preparation (:func:`store_prepared`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsweep.config import ExperimentConfig

_LOCK = threading.Lock()
_PREPARED: set[str] = set()  # tracking stores prepared here, by URI, until the run takes them


def load_experiment(path: str, overrides: list[str]) -> "ExperimentConfig":
    """:func:`fedsweep.config.load_config` (``fedsweep run``, ``fedsweep bench run``), and the store of
    a config that tracks prepared (:func:`prepare_store`)."""
    from fedsweep.config import load_config

    cfg = load_config(path, overrides)
    if cfg.tracking.enabled:
        prepare_store(cfg.tracking.uri)
    return cfg


def load_study(path: str, overrides: list[str]) -> tuple[Any, Any]:
    """:func:`fedsweep.config.sweep.load_sweep` (``fedsweep tune``), and its store prepared (a study's
    driver always tracks)."""
    from fedsweep.config.sweep import load_sweep

    sweep, base = load_sweep(path, overrides)
    prepare_store(sweep.tracking_uri)
    return sweep, base


def prepare_store(uri: str) -> None:
    """MLflow's import and the store's schema check (``tracking.prepare_store``: 2.3 CPU-seconds on the
    2-core VM) here, beside Ray's start, instead of later beside the actors' imports. Made before
    anything else in the driver imports MLflow, never beside it: two threads importing MLflow at once
    can meet its circular imports half-initialised. A failure is left to the run, which repeats the
    preparation where it always did and reports the error there."""
    try:
        from fedsweep.orchestrator.tracking import prepare_store as prepare

        prepare(uri)
    except Exception:  # noqa: BLE001  (repeated, and reported, by the run)
        return
    with _LOCK:
        _PREPARED.add(uri)


def store_prepared(uri: str) -> bool:
    """Whether :func:`prepare_store` prepared ``uri`` in this process, taken once: a second run in the
    same process checks the store again."""
    with _LOCK:
        if uri not in _PREPARED:
            return False
        _PREPARED.discard(uri)
        return True
