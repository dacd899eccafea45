"""MLflow tracking through ``MlflowClient`` (no global active run, safe inside Tune trials).

The store is created once, by the driver, before any trial or actor starts: concurrent
schema creation on sqlite races.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient, create_store

from fedsweep.orchestrator.tracking.ui import NOTE_TAG, VIEW_KEY, VIEW_TAG_PREFIX, save_view
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


def end_abandoned(uri: str, run_id: str) -> bool:
    """End run ``run_id`` KILLED where it is still RUNNING (its driver is gone); whether it was."""
    client = MlflowClient(tracking_uri=uri)
    if client.get_run(run_id).info.status != "RUNNING":
        return False
    client.set_terminated(run_id, status="KILLED")
    return True


RUN_CHARTS = ["test_loss", "train_loss", "accuracy"]


def ensure_view(client: MlflowClient, experiment_id: str, metric: str = "test_loss", mode: str = "min",
                replace: bool = False) -> None:
    """Save fedsweep's view of the experiment (see ``mlflow_ui``) unless one is there (``replace``: a
    study's own metric wins over the default a single run writes)."""
    if not replace and VIEW_TAG_PREFIX + VIEW_KEY in client.get_experiment(experiment_id).tags:
        return
    save_view(client, experiment_id, metric, mode, RUN_CHARTS)


class Tracker:
    """One MLflow run (created, or continued with ``run_id``) and its writes, which go through the
    outbox in ``folder`` (``tracking.outbox``: nothing a round does waits on the tracking server, and
    nothing needs it to start). ``say(line)``: where the outbox announces that the server went away
    or came back; ``on_open(run_id)``: told the run's id once the server made the run, where it did
    not answer at once (:attr:`run_id` is None until then)."""

    def __init__(self, uri: str, experiment: str, run_name: str | None = None, run_id: str | None = None,
                 tags: dict[str, str] | None = None, parent_run_id: str | None = None, folder=None,
                 say: Callable[[str], None] | None = None, find: bool = False,
                 view: dict[str, Any] | None = None, on_open: Callable[[str], None] | None = None):
        """``find``: where ``run_id`` is not known (a resumed run whose first driver died before it kept the
        id), continue the run tagged with the same run folder (``fedsweep.run_dir``) if the store has one,
        before creating another. ``view``: fedsweep's saved view of the experiment (``metric``, ``mode``,
        ``charts``, ``replace``), written with the run's opening."""
        from fedsweep.orchestrator.tracking.outbox import RUN_DIR_TAG, Outbox, unreachable

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.outbox = Outbox(uri, Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="fedsweep-outbox-")),
                             say, start=False, client=self.client, on_open=on_open)
        run_id = run_id or self.outbox.run_id  # (an opening an earlier driver queued, and the server took)
        if run_id:
            self.outbox.run_id = run_id
            self.outbox.put({"op": "running", "run": run_id})
        else:
            self.outbox.open(experiment, run_name, dict(tags or {}), parent_run_id,
                             (tags or {}).get(RUN_DIR_TAG) if find else None, view, artifact_root(uri))
            try:  # the server answers (as it mostly does): the run exists before the constructor returns
                while self.outbox.run_id is None and self.outbox.waiting():
                    if not self.outbox.deliver_one(self.client):
                        break
            except Exception as exc:  # noqa: BLE001  (the sender takes it again)
                if not unreachable(exc):
                    raise
        self.outbox.start()

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id; None while its opening waits for the server."""
        return self.outbox.run_id

    def _run(self) -> str:
        return self.outbox.run_ref()

    def log_params(self, params: dict[str, str]) -> None:
        items = sorted((k[:250], v[:6000]) for k, v in params.items())
        for i in range(0, len(items), 100):
            self.outbox.batch(self._run(), params=dict(items[i:i + 100]))

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp: int | None = None) -> None:
        """Metrics at ``step``, all with one ``timestamp`` (ms; now if not given: a write sent twice
        with its timestamp is logged once)."""
        ts = int(time.time() * 1000) if timestamp is None else int(timestamp)
        items = [(k, float(v), ts, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), MAX_BATCH):
            self.outbox.batch(self._run(), metrics=items[i:i + MAX_BATCH])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.outbox.batch(self._run(), tags=tags)

    def set_note(self, markdown: str) -> None:
        """The run's description, which MLflow's UI renders as Markdown."""
        self.set_tags({NOTE_TAG: markdown})

    def log_text(self, text: str, path: str) -> None:
        self.log_bytes(text.encode(), path)

    def log_bytes(self, data: bytes, path: str) -> None:
        self.outbox.artifact(self._run(), path, data)

    def log_round(self, summary: dict[str, Any]) -> None:
        """A round's record (``actors.server``: its metrics, each client's, artifacts, failures), every
        metric with the record's ``logged_at`` timestamp; the metric ``round`` last, once everything
        else of the round is written (``fedsweep runs`` counts the rounds done by it)."""
        rnd = summary["round"]
        ts = summary.get("logged_at")
        metrics = dict(summary["metrics"])
        for cid, values in summary["client_metrics"].items():
            for key, value in values.items():
                metrics[f"client/{int(cid):03d}/{key}"] = value
        self.log_metrics(metrics, step=rnd, timestamp=ts)
        for name, data in summary.get("artifacts", {}).items():
            self.log_bytes(data if isinstance(data, bytes) else str(data).encode(), f"round_{rnd:04d}/{name}")
        if summary.get("failures"):
            self.log_text(json.dumps(summary["failures"], indent=1), f"round_{rnd:04d}/failures.json")
        if summary.get("retried"):
            self.log_text(json.dumps(summary["retried"], indent=1), f"round_{rnd:04d}/retried.json")
        self.log_metrics({"round": float(rnd)}, step=rnd, timestamp=ts)

    def finish(self, status: str = "FINISHED", wait_s: float = 900.0, leave_when_away: bool = False) -> int:
        """End the run with ``status`` once every write before it is delivered, waiting for the server
        up to ``wait_s`` seconds (``leave_when_away``: not while it does not answer); the number of
        writes still waiting (sent by a resumed run, the study's driver or ``fedsweep runs --sync``)."""
        self.outbox.status(self._run(), status)
        left = self.outbox.drain(wait_s, leave_when_away=leave_when_away)
        self.outbox.close()
        return left
