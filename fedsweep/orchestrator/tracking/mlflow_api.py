"""The one module of fedsweep that imports MLflow (``tests/test_contract.py`` checks).

The driver prepares MLflow's store in a thread while Ray starts (``preflight.prepare_store_soon``).
Another thread importing MLflow at the same time is safe only through one module, whose module
lock it then waits on: inside MLflow's own circular imports two threads can meet a module
half-initialised (``fedsweep tune`` once did, importing ``mlflow.tracking`` directly).
"""

from __future__ import annotations

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient

from fedsweep.storage import sqlite_file

__all__ = ["Metric", "MlflowClient", "Param", "RunStatus", "RunTag", "create_store"]


def create_store(uri: str) -> None:
    """The work of :func:`prepare_store`: the sqlite file's folder, and the schema through a first query."""
    db = sqlite_file(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
