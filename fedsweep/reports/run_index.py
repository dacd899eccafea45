"""What ``fedsweep runs`` lists: the studies and runs an MLflow store holds, read back from it.

Every run fedsweep starts carries the tags ``fedsweep.kind`` (``study``, ``trial`` or ``run``),
``method``, ``variant``, ``seed`` and ``fedsweep.run_dir`` (its run folder, which holds the
checkpoints), and logs the metric ``round`` every round; a study's run carries the study's
folder and its sweep parameters. From those alone this module builds the rows, so that a user
finds what to ``--resume`` or ``compare`` without opening MLflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FINAL_METRICS = ("test_loss", "accuracy")
"""What a run outside a study is summed up by (a study's trials: the study's own metric)."""


@dataclass
class StudyRow:
    experiment: str
    name: str
    status: str
    trials_finished: int
    trials: int
    metric: str
    best: str
    where: str
    run_id: str


@dataclass
class RunRow:
    experiment: str
    name: str
    method: str
    study: str
    status: str
    rounds_done: int | None
    rounds: int | None
    final: str
    checkpoints: str
    run_id: str


def _fmt(key: str, value: Any) -> str:
    return f"{key} {value:.4g}" if isinstance(value, (int, float)) and math.isfinite(value) else "—"


def _rounds_done(client, run) -> int | None:
    if "round" in run.data.metrics:
        return int(run.data.metrics["round"])
    history = client.get_metric_history(run.info.run_id, "train_loss")  # runs from before the ``round`` metric
    return max((m.step for m in history), default=0) if history else None


def _checkpoints(run) -> str:
    run_dir = run.data.tags.get("fedsweep.run_dir")
    if not run_dir:
        return "—"
    if "://" in run_dir:
        return f"{run_dir}/checkpoints"
    ckpt = Path(run_dir) / "checkpoints"
    return short_path(ckpt) if ckpt.exists() else f"{short_path(ckpt)} (gone)"


def short_path(path: Path | str) -> str:
    """``path`` relative to the working directory where it lies under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def collect(uri: str, experiment: str | None = None, limit: int = 50) -> tuple[list[StudyRow], list[RunRow]]:
    """Studies and runs of ``experiment`` (every experiment if None), newest first, at most ``limit`` runs."""
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient  # MLflow only through tracking.mlflow_api (preflight)

    client = MlflowClient(tracking_uri=uri)
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise ValueError(f"no MLflow experiment named {experiment!r} in {uri} (there are: {', '.join(names) or 'none'})")
        experiments = [exp]
    else:
        experiments = client.search_experiments()
    names = {e.experiment_id: e.name for e in experiments}
    if not names:
        return [], []
    runs = client.search_runs(list(names), max_results=max(limit, 1) * 4, order_by=["attributes.start_time DESC"])
    studies = [r for r in runs if r.data.tags.get("fedsweep.kind") == "study"]
    study_names = {r.info.run_id: r.data.tags.get("fedsweep.study", r.info.run_name) for r in studies}
    study_metric = {r.info.run_id: (r.data.params.get("sweep.metric", "test_loss"), r.data.params.get("sweep.mode", "min"))
                    for r in studies}
    children: dict[str, list] = {}
    for r in runs:
        parent = r.data.tags.get("mlflow.parentRunId")
        if parent:
            children.setdefault(parent, []).append(r)

    study_rows = []
    for s in studies:
        metric, mode = study_metric[s.info.run_id]
        kids = children.get(s.info.run_id, [])
        done = [k for k in kids if k.info.status == "FINISHED" and metric in k.data.metrics]
        best = None
        if done:
            pick = min if mode == "min" else max
            best = pick(done, key=lambda k: k.data.metrics[metric])
        study_rows.append(StudyRow(
            names[s.info.experiment_id], study_names[s.info.run_id], s.info.status, len(done),
            int(s.data.params.get("sweep.trials", len(kids)) or 0), metric,
            f"{best.info.run_name}: {_fmt(metric, best.data.metrics[metric])}" if best else "—",
            short_path(s.data.tags["fedsweep.study_dir"]) if "fedsweep.study_dir" in s.data.tags else "—",
            s.info.run_id))

    run_rows = []
    for r in runs:
        if r.data.tags.get("fedsweep.kind") == "study":
            continue
        parent = r.data.tags.get("mlflow.parentRunId")
        if parent in study_metric:
            keys = (study_metric[parent][0],)
        else:
            keys = tuple(k for k in FINAL_METRICS if k in r.data.metrics)
        final = ", ".join(_fmt(k, r.data.metrics.get(k)) for k in keys) or "—"
        rounds = r.data.params.get("rounds")
        run_rows.append(RunRow(
            names[r.info.experiment_id], r.info.run_name or r.info.run_id[:8],
            r.data.tags.get("method") or r.data.params.get("algorithm", "?"), study_names.get(parent, ""),
            r.info.status, _rounds_done(client, r), int(rounds) if rounds and rounds.isdigit() else None,
            final, _checkpoints(r), r.info.run_id))
        if len(run_rows) >= limit:
            break
    return study_rows, run_rows
