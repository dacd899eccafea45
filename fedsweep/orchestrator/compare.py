"""``fedsweep compare``: an MLflow experiment's runs as a comparison report.

Rows are methods (a study's variant and swept values, or a plain run's algorithm); values
are the final round's metrics, mean ± std over seeds, the best in each column marked. Plots:
the metric per round for each method, per-client bars at the last round, and — for sweeps
over numeric hyperparameters — the metric against each of them. Written to
``results/reports/NAME/`` and logged to the study's parent run.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

COLUMNS = [  # (metric, header, better)
    ("accuracy", "accuracy", "max"),
    ("test_loss", "test loss", "min"),
    ("train_loss", "train loss", "min"),
    ("bytes_per_round", "MiB / round", "min"),
    ("seconds_per_round", "s / round", "min"),
]


@dataclass
class RunRow:
    run_id: str
    label: str
    seed: str
    final: dict[str, float]
    history: dict[int, float]
    clients: dict[int, float]
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


def collect(client: MlflowClient, experiment: str, metric: str, all_runs: bool = False
            ) -> tuple[list[RunRow], str | None]:
    """Finished runs with ``metric``: by default the children of the experiment's newest study
    (or, without studies, every run); ``all_runs`` takes every finished run of the experiment."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no MLflow experiment named {experiment!r}")
    runs = client.search_runs([exp.experiment_id], max_results=5000)
    studies = sorted((r for r in runs if r.data.tags.get("fedsweep.kind") == "study"), key=lambda r: r.info.start_time)
    parent = studies[-1].info.run_id if studies else None
    rows = []
    for r in runs:
        if r.data.tags.get("fedsweep.kind") == "study" or metric not in r.data.metrics:
            continue
        if r.info.status != "FINISHED":
            continue
        if parent and not all_runs and r.data.tags.get("mlflow.parentRunId") != parent:
            continue
        hist = {m.step: m.value for m in client.get_metric_history(r.info.run_id, metric)}
        final = {metric: hist[max(hist)]}
        for key in ("test_loss", "train_loss", "accuracy"):
            if key in r.data.metrics:
                final.setdefault(key, r.data.metrics[key])
        per_round = defaultdict(float)
        for key in ("bytes_up", "bytes_down"):
            for m in client.get_metric_history(r.info.run_id, key):
                per_round[m.step] += m.value
        if per_round:
            final["bytes_per_round"] = float(np.mean(list(per_round.values()))) / 2 ** 20
        secs = [m.value for m in client.get_metric_history(r.info.run_id, "round_seconds")]
        if secs:
            final["seconds_per_round"] = float(np.mean(secs))
        clients = {int(k.split("/")[1]): v for k, v in r.data.metrics.items()
                   if k.startswith("client/") and k.endswith("/" + metric)}
        label = r.data.tags.get("fedsweep.label") or r.data.params.get("algorithm", "?")
        rows.append(RunRow(r.info.run_id, label, r.data.params.get("seed", "0"), final, hist, clients,
                           dict(r.data.params), dict(r.data.tags)))
    if not rows:
        raise ValueError(f"experiment {experiment!r} has no run with the metric {metric!r}")
    return rows, parent


def by_label(rows: list[RunRow]) -> dict[str, list[RunRow]]:
    """Runs grouped by comparison row (seeds of one method together), rows sorted by name."""
    groups: dict[str, list[RunRow]] = defaultdict(list)
    for row in rows:
        groups[row.label].append(row)
    return dict(sorted(groups.items()))


def summarise(rows: list[RunRow]) -> dict[str, dict[str, tuple[float, float, int]]]:
    table = {}
    for lab, group in by_label(rows).items():
        cells = {}
        for key, _, _ in COLUMNS:
            vals = [g.final[key] for g in group if key in g.final and not math.isnan(g.final[key])]
            if vals:
                cells[key] = (float(np.mean(vals)), float(np.std(vals)), len(vals))
        table[lab] = cells
    return table


def markdown(table, metric: str) -> str:
    cols = [(metric, metric, "min" if "loss" in metric else "max")] + [c for c in COLUMNS if c[0] != metric]
    best = {}
    for key, _, better in cols:
        vals = [cells[key][0] for cells in table.values() if key in cells]
        if vals:
            best[key] = max(vals) if better == "max" else min(vals)
    head = "| method | seeds | " + " | ".join(h for _, h, _ in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for lab, cells in table.items():
        n = max((c[2] for c in cells.values()), default=0)
        out = []
        for key, _, _ in cols:
            if key not in cells:
                out.append("—")
                continue
            mean, std, _ = cells[key]
            text = f"{mean:.4g} ± {std:.2g}" if n > 1 else f"{mean:.4g}"
            out.append(f"**{text}**" if math.isclose(mean, best[key], rel_tol=1e-12) else text)
        lines.append(f"| {lab} | {n} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def _figure():
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure(figsize=(7, 4.2), dpi=110)


def plot_rounds(rows: list[RunRow], metric: str, path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    for lab, group in by_label(rows).items():
        steps = sorted({s for g in group for s in g.history})
        mean = [np.mean([g.history[s] for g in group if s in g.history]) for s in steps]
        std = [np.std([g.history[s] for g in group if s in g.history]) for s in steps]
        ax.plot(steps, mean, marker="o", label=lab)
        if len(group) > 1:
            ax.fill_between(steps, np.subtract(mean, std), np.add(mean, std), alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per round (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, bbox_inches="tight")


def plot_clients(rows: list[RunRow], metric: str, path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    groups = by_label(rows)
    cids = sorted({c for r in rows for c in r.clients})
    width = 0.8 / max(len(groups), 1)
    for i, (lab, group) in enumerate(groups.items()):
        vals = [np.mean([r.clients[c] for r in group if c in r.clients] or [np.nan]) for c in cids]
        ax.bar(np.arange(len(cids)) + i * width, vals, width, label=lab)
    ax.set_xticks(np.arange(len(cids)) + 0.4 - width / 2, [str(c) for c in cids])
    ax.set_xlabel("client")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per client at the last round")
    ax.legend(fontsize=7)
    fig.savefig(path, bbox_inches="tight")


def plot_hyperparameters(rows: list[RunRow], metric: str, out: Path, swept: set[str]) -> list[Path]:
    """Metric against each swept numeric hyperparameter (studies only), one line per variant.

    The runs' params are their flattened configs, so a swept path (``drift.delta``) is a param.
    """
    paths = []
    for key in sorted(swept):
        points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            try:
                x = float(r.params[key])
            except (KeyError, ValueError):
                continue
            variant = r.label.split(" ")[0]
            points[variant][x].append(r.final[metric])
        if not points:
            continue
        fig = _figure()
        ax = fig.add_subplot()
        for variant, series in sorted(points.items()):
            xs = sorted(series)
            ax.errorbar(xs, [np.mean(series[x]) for x in xs], yerr=[np.std(series[x]) for x in xs], marker="o",
                        capsize=3, label=variant)
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} against {key} (mean ± std over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out / f"{metric}_vs_{key.replace('.', '_')}.png"
        fig.savefig(path, bbox_inches="tight")
        paths.append(path)
    return paths


def compare(experiment: str, uri: str = "sqlite:///results/mlflow.db", out_dir: str = "results/reports",
            metric: str = "accuracy", all_runs: bool = False) -> tuple[Path, str]:
    """Write the report; returns (report.md path, the Markdown table)."""
    client = MlflowClient(tracking_uri=uri)
    rows, parent = collect(client, experiment, metric, all_runs)
    swept: set[str] = set()
    for r in rows:
        swept.update(json.loads(r.tags.get("fedsweep.swept", "[]")))
    out = Path(out_dir) / experiment
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(summarise(rows), metric)
    plot_rounds(rows, metric, out / f"{metric}_per_round.png")
    plot_clients(rows, metric, out / f"{metric}_per_client.png")
    curves = plot_hyperparameters(rows, metric, out, swept)
    lines = [f"# {experiment}: comparison", "",
             f"{len(rows)} runs; final-round values, mean ± std over seeds; best in each column in bold. "
             f"MiB / round: bytes up + down of all sampled clients per round.", "", table, "",
             f"![{metric} per round]({metric}_per_round.png)", "", f"![{metric} per client]({metric}_per_client.png)"]
    lines += ["", *[f"![{p.stem}]({p.name})" for p in curves]]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    if parent:
        for f in sorted(out.iterdir()):
            client.log_artifact(parent, str(f), "report")
    return report, table
