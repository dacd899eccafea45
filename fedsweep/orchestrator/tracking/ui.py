"""What MLflow's web UI (3.17) shows when a user opens an experiment fedsweep made.

Three facts about that UI, each checked in headless Chromium (``tests/test_study.py``, the browser test):

* The page an experiment opens on follows the UI's *workflow type*: the ``workflowType`` URL
  parameter, else the browser's last choice, else ``genai`` (a traces overview, empty for us).
  The experiment-kind tag (``mlflow.experimentKind``) is what MLflow's own clients and earlier
  UIs read to tell a training experiment from a GenAI one; fedsweep sets it, and the link it
  prints names the workflow type as well.
* A study's child runs sit collapsed under their parent while the table is sorted by start time
  (MLflow nests runs only then); sorted by a metric the table is flat, every child on its own row.
* A *saved view* is an experiment tag ``mlflow.sharedViewState.<key>`` holding
  ``{"name", "createdAt", "updatedAt", "state"}``, ``state`` the page's search facets and UI state
  as JSON; ``?viewStateShareKey=<key>`` opens it, and the UI lists it under "Views".

So fedsweep saves one view per experiment — sorted by the study's metric (flat, best first),
that metric and the method, variant and seed as columns, and a first chart section with the
metric per round for every run — and prints the link that opens it.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

KIND_TAG = "mlflow.experimentKind"
KIND_TRAINING = "custom_model_development"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_KEY = "fedsweep"
NOTE_TAG = "mlflow.note.content"
RUN_TAGS = ("method", "variant", "seed", "num_clients")
"""Tags every run fedsweep starts carries (``fedsweep runs`` and the saved view read them)."""
DEFAULT_UI = "http://127.0.0.1:5000"


def column(group: str, name: str) -> str:
    """A runs-table column key as the UI writes it: ``metrics.`test_loss```."""
    return f"{group}.`{name}`"


def line_chart(uid: str, section: str, metric: str) -> dict[str, Any]:
    """One line chart of ``metric`` against the round (MLflow's step), for up to 50 runs."""
    return {"uuid": uid, "type": "LINE", "runsCountToCompare": 50, "metricSectionId": section, "deleted": False,
            "isGenerated": False, "displayName": metric, "metricKey": metric, "lineSmoothness": 0,
            "xAxisScaleType": "linear", "scaleType": "linear", "range": {}, "xAxisKey": "step",
            "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False,
            "useGlobalXaxisKey": True, "useGlobalLineSmoothing": True}


def view_state(metric: str, mode: str, charts: list[str]) -> dict[str, Any]:
    """The saved view's page state: runs sorted by ``metric`` (best first; the table is flat then),
    columns for the metric and the run tags, and a section "fedsweep" charting ``charts`` per round
    ahead of the sections the UI generates for the other metrics."""
    section = "fedsweep-section"
    metrics = list(dict.fromkeys([metric, *charts]))
    return {
        "searchFilter": "", "orderByKey": column("metrics", metric), "orderByAsc": mode == "min",
        "startTime": "ALL", "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
        "selectedColumns": [column("metrics", m) for m in metrics] + [column("tags", t) for t in RUN_TAGS],
        "columnOrder": [], "columnWidths": {}, "runsHiddenMode": "FIRST_20_RUNS",
        "compareRunSections": [{"uuid": section, "name": f"fedsweep: {metric} per round", "display": True,
                                "isReordered": True, "deleted": False, "isGenerated": False}],
        "compareRunCharts": [line_chart(f"fedsweep-chart-{i}", section, m) for i, m in enumerate(metrics)],
        "viewMaximized": False, "runListHidden": False, "isAccordionReordered": True,
        "useGroupedValuesInCharts": True, "hideEmptyCharts": True, "groupBy": None, "groupsExpanded": {},
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def save_view(client, experiment_id: str, metric: str, mode: str, charts: list[str], name: str = "fedsweep") -> None:
    """Write (or overwrite) the experiment's saved view ``VIEW_KEY``."""
    now = int(time.time() * 1000)
    envelope = {"name": name, "createdAt": now, "updatedAt": now,
                "state": json.dumps(view_state(metric, mode, charts), separators=(",", ":"))}
    client.set_experiment_tag(experiment_id, VIEW_TAG_PREFIX + VIEW_KEY, json.dumps(envelope, separators=(",", ":")))


def mark_training(client, experiment) -> None:
    """Tag an experiment as model training (once)."""
    if experiment.tags.get(KIND_TAG) != KIND_TRAINING:
        client.set_experiment_tag(experiment.experiment_id, KIND_TAG, KIND_TRAINING)


def experiment_path(experiment_id: str, view: bool = True, charts: bool = False) -> str:
    """The UI route (after ``#``) that opens an experiment on its runs table, with fedsweep's view."""
    query = "workflowType=machine_learning"
    if view:
        query += f"&viewStateShareKey={quote(VIEW_KEY)}"
    if charts:
        query += "&compareRunsMode=CHART"
    return f"/experiments/{experiment_id}/runs?{query}"


def open_hint(uri: str, experiment_id: str, ui: str = DEFAULT_UI) -> str:
    """Two lines telling a user how to see an experiment: the command and the page to open."""
    return (f"open it with: mlflow ui --backend-store-uri {uri}\n"
            f"  then: {ui}/#{experiment_path(experiment_id)}")
