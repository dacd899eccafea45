"""What a command hands :func:`fedsweep.orchestrator.ray_runtime.start_while`: its config's loading,
with every import that loading needs (pydantic, the methods, torch through their tensor code) made
inside the function, so in the thread that validates while Ray starts, not in the main thread before
Ray's start. This module imports nothing itself: taking a function from it costs the main thread
nothing (importing ``fedsweep.config`` there used to cost it torch's import, 1.6-2.8 s on the
2-core VM, before Ray's processes were even spawned).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedsweep.config import ExperimentConfig


def load_experiment(path: str, overrides: list[str]) -> "ExperimentConfig":
    """:func:`fedsweep.config.load_config` (``fedsweep run``, ``fedsweep bench run``)."""
    from fedsweep.config import load_config

    return load_config(path, overrides)


def load_study(path: str, overrides: list[str]) -> tuple[Any, Any]:
    """:func:`fedsweep.config.sweep.load_sweep`, and MLflow imported (``fedsweep tune``)."""
    import importlib

    from fedsweep.config.sweep import load_sweep

    importlib.import_module("mlflow.tracking")  # the study's driver tracks: imported here, beside Ray's start

    return load_sweep(path, overrides)
