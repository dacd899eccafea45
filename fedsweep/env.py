"""Environment defaults for every fedsweep process, set in one place.

Offline and quiet: no hub access (models and data are bundled or local), no tokenizer thread
pools fighting Ray's workers, no per-actor progress bars or deprecation noise, no MLflow
notices (its schema set-up) between fedsweep's own lines. Values the user
has set are kept.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULTS = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error", "MLFLOW_LOGGING_LEVEL": "WARNING",
            # a tracking server that does not answer is known so within seconds, not minutes of retries:
            # its writes wait in the run's outbox (orchestrator/tracking/outbox.py), training goes on
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
WORKER_ONLY = {"PYTHONWARNINGS": "ignore::FutureWarning"}
FORWARDED = ("FEDSWEEP_PLUGINS", "FEDSWEEP_KERNELS")
"""Switches the actors must see as the driver has them, where the user has set them: plugins outside
fedsweep (the actors import them too) and whether the C kernels are used."""
LOCAL_RUNTIME_ENV = "FEDSWEEP_LOCAL_RUNTIME"
"""Set (to 1) in a local Ray runtime that fedsweep started with :func:`worker_env` in its environment."""


def apply_defaults() -> None:
    """Set :data:`DEFAULTS` in this process where unset (the CLI and the Ray runtime call it)."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


def worker_env(**extra: str) -> dict[str, str]:
    """Environment variables for Ray actors and jobs: the defaults, as this process has them, plus ``extra``."""
    out = {key: os.environ.get(key, value) for key, value in DEFAULTS.items()}
    out.update(WORKER_ONLY)
    out.update({key: os.environ[key] for key in FORWARDED if os.environ.get(key)})
    out.update(extra)
    return out


def actor_runtime_env(**extra: str) -> dict | None:
    """The ``runtime_env`` for an actor: none inside a local runtime fedsweep started (its workers
    already have :func:`worker_env`, and an actor with a runtime_env of its own cannot use the
    workers Ray starts ahead of time), else the worker environment plus ``extra``."""
    if os.environ.get(LOCAL_RUNTIME_ENV) and not extra:
        return None
    return {"env_vars": worker_env(**extra)}


def cache_home(given: str | None = None) -> Path:
    """Where fedsweep keeps what it makes once per machine (converted weights, built kernels):
    ``given``, else ``$FEDSWEEP_CACHE``, else ``~/.cache/fedsweep``."""
    return Path(given or os.environ.get("FEDSWEEP_CACHE") or Path.home() / ".cache" / "fedsweep")
