"""What a command hands :func:`fedsweep.orchestrator.runtime.ray_runtime.start_while`: its config's loading,
with every import that loading needs (pydantic, the methods, torch through their tensor code) made
inside the function, so in the thread that validates while Ray starts, not in the main thread before
Ray's start. This module imports nothing heavy itself: taking a function from it costs the main
thread nothing (importing ``fedsweep.config`` there used to cost it torch's import, seconds before
Ray's processes were even spawned).

A config that tracks also has its MLflow store prepared (MLflow's import, SQLAlchemy's, the schema
check) in a thread of its own, begun once the config is valid (``tracking.store``): Ray's start
leaves a core mostly idle, and ``tracking.tracker.prepare_store`` in the run's own tracking thread,
which used to pay for it beside the actors' imports, takes the finished preparation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedsweep.orchestrator.tracking.store import prepare_store_soon, store_prepared  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from fedsweep.config import ExperimentConfig


def load_experiment(path: str, overrides: list[str], resume: bool = False) -> "ExperimentConfig":
    """:func:`fedsweep.config.load_config` (``fedsweep run``, ``fedsweep bench run``); with ``resume``,
    the run it would continue checked too (``run_dirs.resumable_run``: a changed config, checkpoints off
    or no earlier run refused here, before Ray starts). A config that tracks has its store prepared in a
    thread of its own (``tracking.store.prepare_store_soon``)."""
    from fedsweep.config import load_config

    cfg = load_config(path, overrides)
    if resume:
        from fedsweep.orchestrator.run_dirs import resumable_run

        resumable_run(cfg)
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
