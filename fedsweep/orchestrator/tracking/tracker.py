"""MLflow tracking through ``MlflowClient`` (no global active run, safe inside Tune trials).

The store is created once, by the driver, before any trial or actor starts: concurrent
schema creation on sqlite races.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from fedsweep.orchestrator.tracking.mlflow_api import Metric, MlflowClient, Param, RunStatus, create_store

from fedsweep.orchestrator.tracking.ui import KIND_TAG, KIND_TRAINING, NOTE_TAG, VIEW_KEY, VIEW_TAG_PREFIX, mark_training, save_view
from fedsweep.storage import sqlite_file

MAX_BATCH = 900  # log_batch takes at most 1000 metrics, 100 params


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


def prepare_store(uri: str) -> None:
    """Make sure the sqlite file's folder exists and the schema is created (once, here). A preparation
    begun while Ray started (``store.prepare_store_soon``) is waited for and taken instead; a
    failed one is made again here, and raises here."""
    from fedsweep.orchestrator.tracking.store import store_prepared

    if not store_prepared(uri):
        create_store(uri)


def artifact_root(uri: str) -> str | None:
    """Local stores keep artifacts beside the database under results/mlartifacts."""
    db = sqlite_file(uri)
    return (db.resolve().parent / "mlartifacts").as_uri() if db is not None else None


def run_tags(cfg) -> dict[str, str]:
    """The tags every run carries (a study's trial overrides ``variant`` and adds its own)."""
    from fedsweep.federation.attacks import attackers

    tags = {"method": cfg.algorithm, "variant": cfg.algorithm, "seed": str(cfg.seed),
            "num_clients": str(cfg.clients.num_clients), "fedsweep.kind": "run"}
    b = cfg.clients.byzantine
    if b.fraction:  # which clients attacked: a robustness result is read against them
        tags["fedsweep.attackers"] = ",".join(map(str, attackers(cfg.seed, cfg.clients.num_clients, b.fraction)))
    return tags


RUN_CHARTS = ["test_loss", "train_loss", "accuracy"]


def ensure_view(client: MlflowClient, experiment_id: str, metric: str = "test_loss", mode: str = "min",
                replace: bool = False) -> None:
    """Save fedsweep's view of the experiment (see ``mlflow_ui``) unless one is there (``replace``: a
    study's own metric wins over the default a single run writes)."""
    if not replace and VIEW_TAG_PREFIX + VIEW_KEY in client.get_experiment(experiment_id).tags:
        return
    save_view(client, experiment_id, metric, mode, RUN_CHARTS)


class Tracker:
    def __init__(self, uri: str, experiment: str, run_name: str | None = None, run_id: str | None = None,
                 tags: dict[str, str] | None = None, parent_run_id: str | None = None):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            root = artifact_root(uri)
            exp_id = self.client.create_experiment(experiment, artifact_location=f"{root}/{experiment}" if root else None,
                                                   tags={KIND_TAG: KIND_TRAINING})
        else:
            exp_id = exp.experiment_id
            mark_training(self.client, exp)
        self.experiment_id = exp_id
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            tags = dict(tags or {})
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id

    def log_params(self, params: dict[str, str]) -> None:
        items = [Param(k[:250], v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        for i in range(0, len(items), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + MAX_BATCH])

    def set_note(self, markdown: str) -> None:
        """The run's description, which MLflow's UI renders as Markdown."""
        self.client.set_tag(self.run_id, NOTE_TAG, markdown)

    def log_text(self, text: str, path: str) -> None:
        self.client.log_text(self.run_id, text, path)

    def log_bytes(self, data: bytes, path: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / Path(path).name
            local.write_bytes(data)
            parent = str(Path(path).parent)
            self.client.log_artifact(self.run_id, str(local), None if parent == "." else parent)

    def log_round(self, summary: dict[str, Any]) -> None:
        rnd = summary["round"]
        metrics = {**summary["metrics"], "round": float(rnd)}  # the last one: rounds done (``fedsweep runs``)
        for cid, values in summary["client_metrics"].items():
            for key, value in values.items():
                metrics[f"client/{int(cid):03d}/{key}"] = value
        self.log_metrics(metrics, step=rnd)
        for name, data in summary.get("artifacts", {}).items():
            self.log_bytes(data if isinstance(data, bytes) else str(data).encode(), f"round_{rnd:04d}/{name}")
        if summary.get("failures"):
            self.log_text(json.dumps(summary["failures"], indent=1), f"round_{rnd:04d}/failures.json")
        if summary.get("retried"):
            self.log_text(json.dumps(summary["retried"], indent=1), f"round_{rnd:04d}/retried.json")

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(RunStatus.from_string(status)))
