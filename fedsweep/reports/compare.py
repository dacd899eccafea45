"""``fedsweep compare``: an MLflow experiment's runs as a comparison report a reviewer can check.

Rows are methods (a study's variant and swept values, or a plain run's algorithm); values are
the final round's metrics with a 95 % interval — Student-t over seeds, or with one seed a
bootstrap over clients (the table says which). Every method is tested against a baseline
(``fedavg`` by default) with the run as the unit: a paired t test over the seeds of each run's mean
over its clients (``reports.verdicts``, the statistics the cards and a study's question use), Holm
within each metric; a cell is bold only where that difference is significant at ``alpha``. Fewer
than three runs a row, or runs without spread, give no p-value: undecided. Client-level differences
are shown as description only (the clients of a run share its aggregate: they are not independent).
Plots: the metric per round with 95 % bands, a clients × methods heatmap of the final metric (and
of test loss), communication against the final metric, and — for sweeps over numeric
hyperparameters — the metric against each of them. Written to ``results/reports/NAME/`` and
logged to the study's parent run.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsweep.metrics import EVAL_WEIGHT
from fedsweep.orchestrator.tracking.ui import NOTE_TAG
from fedsweep.reports.pairing import different_data
from fedsweep.reports import verdicts as vd
from fedsweep.reports.significance import Interval, bootstrap_interval, t_interval
from fedsweep.reports.figures import figure
from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient  # MLflow only through tracking.mlflow_api (preflight)

COLUMNS = [  # (metric, header, better)
    ("accuracy", "accuracy", "max"),
    ("test_loss", "test loss", "min"),
    ("train_loss", "train loss", "min"),
    ("bytes_per_round", "MiB / round", "min"),
    ("seconds_per_round", "s / round", "min"),
    ("train_seconds_per_round", "train s / round", "min"),
    ("own_work_seconds_per_round", "own work s / round", "min"),
    ("eval_seconds_per_round", "eval s / round", "min"),
]
PER_CLIENT = ("accuracy", "test_loss", "train_loss")
"""Metrics logged per client (``client/NNN/<metric>``): these get bootstrap intervals and paired tests."""
LEVEL = 0.95


def better_of(metric: str) -> str:
    for key, _, better in COLUMNS:
        if key == metric:
            return better
    return "min" if "loss" in metric or "seconds" in metric else "max"


@dataclass
class RunRow:
    run_id: str
    label: str
    seed: str
    final: dict[str, float]
    history: dict[int, float]
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    per_client: dict[str, dict[int, float]] = field(default_factory=dict)
    """Final per-client value of each PER_CLIENT metric (and the example counts), by client id."""
    client_history: dict[int, dict[int, float]] = field(default_factory=dict)
    """The compared metric per round, per client: {round: {cid: value}}."""


def _history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def collect(client: MlflowClient, experiment: str, metric: str, all_runs: bool = False,
            also: tuple[str, ...] = ()) -> tuple[list[RunRow], str | None]:
    """Finished runs with ``metric``: by default the children of the experiment's newest study
    (or, without studies, every run); ``all_runs`` takes every finished run of the experiment.
    Each run-level metric of ``also`` a run logged enters its ``final`` with its last round's value."""
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
        rid, logged = r.info.run_id, r.data.metrics
        hist = _history(client, rid, metric)
        final = {metric: hist[max(hist)]}
        for key in (*PER_CLIENT, *also):  # MLflow's logged value of a metric is its last step's
            if key in logged:
                final.setdefault(key, logged[key])
        per_round = defaultdict(float)
        for key in ("bytes_up", "bytes_down"):
            for step, value in _history(client, rid, key).items():
                per_round[step] += value
        if per_round:
            final["bytes_per_round"] = float(np.mean(list(per_round.values()))) / 2 ** 20
        for key, out in (("round_seconds", "seconds_per_round"), ("eval_seconds", "eval_seconds_per_round"),
                         ("phase/train_s", "train_seconds_per_round"), ("phase/own_work_s", "own_work_seconds_per_round")):
            values = list(_history(client, rid, key).values())
            if values:
                final[out] = float(np.mean(values))
        per_client: dict[str, dict[int, float]] = defaultdict(dict)
        for key, value in logged.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "client" and parts[1].isdigit():
                per_client[parts[2]][int(parts[1])] = value
        client_history: dict[int, dict[int, float]] = defaultdict(dict)
        for cid in per_client.get(metric, {}):
            for step, value in _history(client, rid, f"client/{cid:03d}/{metric}").items():
                client_history[step][cid] = value
        label = r.data.tags.get("fedsweep.label") or r.data.params.get("algorithm", "?")
        rows.append(RunRow(rid, label, r.data.params.get("seed", "0"), final, hist, dict(r.data.params),
                           dict(r.data.tags), dict(per_client), dict(client_history)))
    if not rows:
        raise ValueError(f"experiment {experiment!r} has no finished run with the metric {metric!r}")
    return rows, parent


def by_label(rows: list[RunRow], first: str | None = None) -> dict[str, list[RunRow]]:
    """Runs grouped by comparison row (seeds of one method together), rows sorted by name with
    the ``first`` row (the baseline) ahead of the others."""
    groups: dict[str, list[RunRow]] = defaultdict(list)
    for row in rows:
        groups[row.label].append(row)
    return dict(sorted(groups.items(), key=lambda kv: (kv[0] != first, kv[0])))


# ------------------------------------------------------------------------------ statistics


def _about(value: float, clients: dict[int, float], counts: dict[int, float] | None = None,
           level: float = LEVEL) -> Interval:
    """The logged ``value`` (a mean over ``clients``) with the percentile-bootstrap interval over the
    clients, example-weighted where every client's count is known; widened to contain ``value``
    where the logged mean was weighted differently."""
    if len(clients) < 2:
        return Interval(value, value, value, 1, "point")
    cids = sorted(clients)
    weights = [counts[c] for c in cids] if counts and all(c in counts for c in cids) else None
    boot = bootstrap_interval([clients[c] for c in cids], weights, level)
    return Interval(value, min(boot.low, value), max(boot.high, value), boot.n, "bootstrap")


def interval(group: list[RunRow], key: str, level: float = LEVEL) -> Interval | None:
    """``key``'s final value over the group's seeds: t over seeds (≥ 2 seeds), else a bootstrap
    over the one run's clients (example-weighted, as the global value is), else the point."""
    vals = [g.final[key] for g in group if key in g.final and not math.isnan(g.final[key])]
    if not vals:
        return None
    if len(vals) > 1:
        return t_interval(vals, level)
    run = next(g for g in group if key in g.final)
    return _about(vals[0], run.per_client.get(key, {}), run.per_client.get(EVAL_WEIGHT.get(key, "")), level)


def pairs(group: list[RunRow], reference: list[RunRow], key: str) -> tuple[list[float], list[float]]:
    """Per-client final values of ``key`` for every (seed, client) both groups evaluated."""
    ref = {(r.seed, c): v for r in reference for c, v in r.per_client.get(key, {}).items()}
    a, b = [], []
    for r in group:
        for c, v in sorted(r.per_client.get(key, {}).items()):
            if (r.seed, c) in ref and not (math.isnan(v) or math.isnan(ref[(r.seed, c)])):
                a.append(v)
                b.append(ref[(r.seed, c)])
    return a, b


def baseline_label(label: str, labels: list[str], baseline: str) -> str | None:
    """The row ``label`` is tested against: the row named ``baseline``; in a sweep whose rows carry
    swept values (``fedavg drift.delta=0.2``), the baseline row with the same values."""
    if baseline in labels:
        return baseline
    suffix = label.split(" ", 1)[1] if " " in label else ""
    candidate = f"{baseline} {suffix}".strip()
    if candidate in labels:
        return candidate
    matches = [lab for lab in labels if lab.split(" ")[0] == baseline]
    return matches[0] if len(matches) == 1 else None


@dataclass
class Test:
    """One method against its baseline on one metric, the run as the unit (``reports.verdicts``)."""

    label: str
    reference: str
    metric: str
    outcome: vd.Outcome | None
    """The paired t test over runs (None: fewer than :data:`verdicts.MIN_UNITS` runs a row, or no spread)."""
    client_pairs: int = 0
    client_mean_diff: float = math.nan
    """Description only: the mean difference over the (seed, client) pairs both evaluated."""
    p_adjusted: float = math.nan
    significant: bool = False
    detectable: float = math.inf
    """The smallest difference these runs detect at 80 % power at Holm's first level of the metric's family."""

    @property
    def mean_diff(self) -> float:
        return self.outcome.estimate if self.outcome is not None else self.client_mean_diff

    @property
    def better(self) -> bool:
        return (self.mean_diff > 0) == (better_of(self.metric) == "max")

    @property
    def undecided(self) -> str | None:
        """Why no p-value: too few runs, or no spread over them; None where tested."""
        if self.outcome is None:
            return f"fewer than {vd.MIN_UNITS} runs a row"
        return self.outcome.undecided


def not_pairable(group: list[RunRow], reference: list[RunRow]) -> str | None:
    """Why ``group``'s clients cannot be paired with ``reference``'s (their data differ at some seed), or None."""
    ref = {r.seed: r for r in reference}
    for r in group:
        other = ref.get(r.seed)
        why = different_data(r.params, other.params) if other is not None else None
        if why:
            return why
    return None


def unpaired_rows(rows: list[RunRow], baseline: str) -> list[tuple[str, str, str]]:
    """(method, baseline, why) of the rows left out of the paired tests: their clients hold other data."""
    groups = by_label(rows)
    labels = list(groups)
    out = []
    for lab, group in groups.items():
        ref = baseline_label(lab, labels, baseline)
        if ref is not None and ref != lab:
            why = not_pairable(group, groups[ref])
            if why:
                out.append((lab, ref, why))
    return out


def paired_tests(rows: list[RunRow], metrics: list[str], baseline: str, alpha: float) -> list[Test]:
    """Every method against its baseline row on each per-client metric, the run as the unit: each run's
    mean over the clients both rows evaluated, paired by seed (``reports.run_values``), a two-sided
    paired t test over the runs (``reports.verdicts``), Holm within a metric over the methods tested. A
    row whose clients hold other data than its baseline's is not paired (:func:`unpaired_rows`)."""
    from fedsweep.reports.run_values import paired_runs, row_values

    groups = by_label(rows)
    labels = list(groups)
    tests: list[Test] = []
    for key in metrics:
        family = []
        for lab, group in groups.items():
            ref = baseline_label(lab, labels, baseline)
            if ref is None or ref == lab or not_pairable(group, groups[ref]):
                continue
            a, b = pairs(group, groups[ref], key)
            if not a:
                continue
            _, ra, rb = paired_runs(row_values(rows, lab, key), row_values(rows, ref, key), lab)
            outcome = vd.paired(lab, "greater", ra, rb) if len(ra) >= vd.MIN_UNITS else None
            family.append(Test(lab, ref, key, outcome, len(a), float(np.mean(np.subtract(a, b)))))
        decided = [t for t in family if t.undecided is None]
        for t, p in zip(decided, vd.holm_of([t.outcome for t in decided])):
            t.p_adjusted = p
            t.significant = p < alpha
            t.detectable = vd.detectable_effect(t.outcome.se, t.outcome.df, alpha, len(decided))
        tests += family
    return tests


def examples_behind(group: list[RunRow]) -> str:
    """Test examples per seed behind accuracy and behind test loss (summed over clients)."""
    out = []
    for key in ("num_test", "num_test_loss"):
        per_run = {int(sum(g.per_client.get(key, {}).values())) for g in group}
        out.append("/".join(str(n) for n in sorted(per_run)) if per_run - {0} else "—")
    return " · ".join(out)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


Summary = dict[str, dict[str, Interval]]
"""Method label -> metric -> its final value with the 95 % interval (metrics a method lacks omitted)."""


def columns(metric: str, also: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """The report's columns, (metric, header, better): the compared metric, then the ``also``
    metrics, then the standard ones."""
    first = [(k, k.replace("_", " "), better_of(k)) for k in dict.fromkeys([metric, *also])]
    return first + [c for c in COLUMNS if c[0] not in {k for k, _, _ in first}]


def summarise(rows: list[RunRow], metric: str, also: tuple[str, ...] = ()) -> Summary:
    keys = [k for k, _, _ in columns(metric, also)]
    return {lab: {k: iv for k in keys if (iv := interval(group, k)) is not None} for lab, group in by_label(rows).items()}


def markdown(rows: list[RunRow], metric: str, tests: list[Test], summary: Summary, baseline: str | None = None,
             also: tuple[str, ...] = ()) -> str:
    """The comparison table: mean [95 % interval] per method and metric; bold (with ▲ better /
    ▼ worse than the baseline) only where the paired test is significant."""
    cols = columns(metric, also)
    verdict = {(t.label, t.metric): t for t in tests if t.significant}
    groups = by_label(rows, baseline)
    present = [c for c in cols if any(c[0] in summary[lab] for lab in groups)]
    head = "| method | seeds | interval | test examples (acc · loss) | " + " | ".join(h for _, h, _ in present) + " |"
    lines = [head, "|" + "---|" * (len(present) + 4)]
    for lab, group in groups.items():
        out, kinds = [], set()
        for key, _, _ in present:
            iv = summary[lab].get(key)
            if iv is None:
                out.append("—")
                continue
            if key in PER_CLIENT or len(group) > 1:
                kinds.add(iv.kind)
            text = _fmt(iv.mean) if iv.kind == "point" else f"{_fmt(iv.mean)} [{_fmt(iv.low)}, {_fmt(iv.high)}]"
            t = verdict.get((lab, key))
            out.append(f"**{text}** {'▲' if t.better else '▼'}" if t else text)
        kind = {"t": "t over seeds", "bootstrap": "bootstrap over clients", "point": "none"}
        name = f"{lab} (baseline)" if lab == baseline else lab
        lines.append(f"| {name} | {len(group)} | {', '.join(kind[k] for k in sorted(kinds)) or '—'} | "
                     f"{examples_behind(group)} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def tests_table(tests: list[Test]) -> str:
    lines = ["| method | against | metric | runs | mean difference (runs) | t | p | p (Holm) | significant | "
             "client pairs: mean difference (description) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in tests:
        o = t.outcome
        why = t.undecided
        t_stat = "—" if why else f"{(o.estimate - o.reference) / o.se:.3g}"
        p = "—" if why else f"{o.p:.3g}"
        holm_p = "—" if why else f"{t.p_adjusted:.3g}"
        verdict = f"undecided ({why})" if why else ("yes" if t.significant else "no")
        runs = o.n if o is not None else "<3"
        lines.append(f"| {t.label} | {t.reference} | {t.metric} | {runs} | {t.mean_diff:+.4g} | {t_stat} | {p} | "
                     f"{holm_p} | {verdict} | {t.client_pairs}: {t.client_mean_diff:+.4g} |")
    return "\n".join(lines)


def findings(tests: list[Test], alpha: float) -> list[str]:
    """The tests in words: each significant difference, what is not, and what could not be tested."""
    if not tests:
        return ["No paired test was possible: no baseline run, or no per-client values shared with it."]
    out = []
    for t in [t for t in tests if t.significant]:
        o = t.outcome
        direction = ("higher" if o.estimate > 0 else "lower")
        out.append(f"- **{t.label}** has a {direction} {t.metric.replace('_', ' ')} than {t.reference} "
                   f"({'better' if t.better else 'worse'}): {o.estimate:+.4g} [{o.low:+.3g}, {o.high:+.3g}] over "
                   f"{o.n} runs, paired t p = {o.p:.3g} (Holm {t.p_adjusted:.3g}) — significant at α = {alpha}.")
    null = [t for t in tests if not t.significant and t.undecided is None]
    if null:
        parts = [f"{t.label} vs {t.reference} on {t.metric.replace('_', ' ')} (difference {t.mean_diff:+.3g}, "
                 f"p = {t.outcome.p:.2g}, Holm {t.p_adjusted:.2g})" for t in null]
        out.append(f"- Not significant at α = {alpha}: " + "; ".join(parts) + ".")
    undecided = [t for t in tests if t.undecided is not None]
    if undecided:
        parts = [f"{t.label} vs {t.reference} on {t.metric.replace('_', ' ')} ({t.undecided}; client pairs: "
                 f"{t.client_mean_diff:+.3g} over {t.client_pairs}, description only)" for t in undecided]
        out.append("- Undecided, no test with the run as the unit: " + "; ".join(parts) + ".")
    if not any(t.significant for t in tests):
        out.insert(0, f"- **No difference is significant at α = {alpha}** with the run as the unit.")
    return out


# ------------------------------------------------------------------------------ plots


STYLES = [(m, ls) for ls in ("-", "--", ":", "-.") for m in ("o", "s", "^", "D", "v", "P", "X", "*")]


def _round_band(group: list[RunRow], step: int) -> Interval | None:
    vals = [g.history[step] for g in group if step in g.history]
    if len(vals) > 1:
        return t_interval(vals)
    if not vals:
        return None
    return _about(vals[0], next(g for g in group if step in g.history).client_history.get(step, {}))


def plot_rounds(rows: list[RunRow], metric: str, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    fig = figure()
    ax = fig.add_subplot()
    for i, (lab, group) in enumerate(by_label(rows).items()):
        steps = sorted({s for g in group for s in g.history})
        bands = [_round_band(group, s) for s in steps]
        marker, style = STYLES[i % len(STYLES)]
        line, = ax.plot(steps, [b.mean for b in bands], marker=marker, linestyle=style, markersize=5,
                        label=lab, alpha=0.9)
        if any(b.kind != "point" for b in bands):
            ax.fill_between(steps, [b.low for b in bands], [b.high for b in bands], color=line.get_color(), alpha=0.12)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per round (shaded: 95 % interval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, bbox_inches="tight")


def client_tasks(client: MlflowClient, rows: list[RunRow]) -> dict[int, str]:
    """Each client's task(s) from a run's ``clients.json`` artifact, where every run agrees."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no progress bar per small file
    seen: dict[int, set[str]] = defaultdict(set)
    for r in rows[:8]:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                local = client.download_artifacts(r.run_id, "clients.json", tmp)
                for c in json.loads(Path(local).read_text()):
                    seen[int(c["cid"])].add(", ".join(c["tasks"][:2]) + (" …" if len(c["tasks"]) > 2 else ""))
        except Exception:  # an old run without the artifact: clients keep their ids only
            continue
    return {cid: next(iter(t)) for cid, t in seen.items() if len(t) == 1}


def plot_heatmap(rows: list[RunRow], key: str, path: Path, tasks: dict[int, str]) -> bool:
    """Clients × methods: the final ``key`` per client (mean over seeds), annotated."""
    groups = by_label(rows)
    cids = sorted({c for r in rows for c in r.per_client.get(key, {})})
    if not cids:
        return False
    grid = np.full((len(cids), len(groups)), np.nan)
    for j, group in enumerate(groups.values()):
        for i, c in enumerate(cids):
            vals = [r.per_client[key][c] for r in group if c in r.per_client.get(key, {})]
            if vals:
                grid[i, j] = float(np.mean(vals))
    fig = figure(max(5.0, 1.1 * len(groups) + 2.5), max(3.0, 0.38 * len(cids) + 1.6))
    ax = fig.add_subplot()
    cmap = "viridis" if better_of(key) == "max" else "viridis_r"
    im = ax.imshow(grid, aspect="auto", cmap=cmap)
    fig.colorbar(im, ax=ax, label=f"{key} ({'higher' if better_of(key) == 'max' else 'lower'} is better)")
    ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(cids)), [f"client {c}" + (f" · {tasks[c]}" if c in tasks else "") for c in cids],
                  fontsize=8)
    if grid.size <= 400:
        finite = grid[np.isfinite(grid)]
        mid = float(np.mean([finite.min(), finite.max()])) if finite.size else 0.0
        for i in range(len(cids)):
            for j in range(len(groups)):
                if np.isfinite(grid[i, j]):
                    dark = (grid[i, j] < mid) == (cmap == "viridis")
                    ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")
    ax.set_title(f"{key} per client at the last round (mean over seeds)")
    fig.savefig(path, bbox_inches="tight")
    return True


def plot_communication(summary: Summary, metric: str, path: Path) -> bool:
    """MiB per round against the final metric, one point per method with its 95 % interval."""
    points = [(lab, cells["bytes_per_round"].mean, cells[metric]) for lab, cells in summary.items()
              if "bytes_per_round" in cells and metric in cells]
    if not points:
        return False
    fig = figure()
    ax = fig.add_subplot()
    for i, (lab, x, iv) in enumerate(points):
        marker, _ = STYLES[i % len(STYLES)]
        ax.errorbar([x], [iv.mean], yerr=[[iv.mean - iv.low], [iv.high - iv.mean]], marker=marker, capsize=3,
                    linestyle="none", label=lab)
        ax.annotate(lab, (x, iv.mean), textcoords="offset points", xytext=(5, 4), fontsize=7)
    smallest = min((x for _, x, _ in points if x > 0), default=1.0)
    ax.set_xscale("symlog", linthresh=smallest)
    ax.set_xlabel("MiB per round (up + down, all sampled clients; symlog)")
    ax.set_ylabel(f"final {metric}")
    ax.set_title(f"communication against final {metric} (bars: 95 % interval)")
    ax.grid(alpha=0.3)
    fig.savefig(path, bbox_inches="tight")
    return True


def plot_hyperparameters(rows: list[RunRow], metric: str, out: Path, swept: set[str]) -> list[Path]:
    """Metric against each swept numeric hyperparameter (studies only), one line per variant,
    bars the 95 % t-interval over seeds. A swept path (``drift.delta``) is a run param."""
    paths = []
    for key in sorted(swept):
        points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            try:
                x = float(r.params[key])
            except (KeyError, ValueError):
                continue
            if metric not in r.final:
                continue
            points[r.label.split(" ")[0]][x].append(r.final[metric])
        if not points:
            continue
        fig = figure()
        ax = fig.add_subplot()
        for i, (variant, series) in enumerate(sorted(points.items())):
            xs = sorted(series)
            ivs = [t_interval(series[x]) for x in xs]
            marker, style = STYLES[i % len(STYLES)]
            ax.errorbar(xs, [iv.mean for iv in ivs], yerr=[[iv.mean - iv.low for iv in ivs], [iv.high - iv.mean for iv in ivs]],
                        marker=marker, linestyle=style, capsize=3, label=variant)
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} against {key} (bars: 95 % t-interval over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out / f"{metric}_vs_{key.replace('.', '_')}.png"
        fig.savefig(path, bbox_inches="tight")
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------ the report


def compare(experiment: str, uri: str = "sqlite:///results/mlflow.db", out_dir: str = "results/reports",
            metric: str = "accuracy", all_runs: bool = False, baseline: str = "fedavg",
            alpha: float = 0.05, also: tuple[str, ...] = ()) -> tuple[Path, str, list[str]]:
    """Write the report; returns (report.md path, the Markdown table, the findings in words).
    ``also``: run-level metrics (e.g. a method's ``drift_neighbours_mean``) shown as columns
    beside ``metric``, each run's last-round value; a metric no run logged is named as missing."""
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {alpha}")
    client = MlflowClient(tracking_uri=uri)
    rows, parent = collect(client, experiment, metric, all_runs, also)
    absent = [k for k in also if not any(k in r.final for r in rows)]
    if absent:
        raise ValueError(f"no run of {experiment!r} logged {', '.join(absent)} (asked for as a column)")
    swept: set[str] = set()
    for r in rows:
        swept.update(json.loads(r.tags.get("fedsweep.swept", "[]")))
    out = Path(out_dir) / experiment
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):  # plots of an earlier report that this one may not redraw
        old.unlink()
    labels = list(by_label(rows))
    has_baseline = any(baseline_label(lab, labels, baseline) for lab in labels)
    tested = [metric] + [k for k in PER_CLIENT if k != metric]
    tested = [k for k in tested if any(k in r.per_client for r in rows)]
    tests = paired_tests(rows, tested, baseline, alpha) if has_baseline else []
    summary = summarise(rows, metric, also)
    table = markdown(rows, metric, tests, summary, baseline if has_baseline else None, also)
    found = findings(tests, alpha) if has_baseline else []
    for lab, ref, why in unpaired_rows(rows, baseline) if has_baseline else []:
        found.append(f"- **{lab}** is not tested against {ref}: their clients hold different data ({why}), so a "
                     f"client-by-client pairing would compare unrelated test sets.")
    asked = _answer(client, parent, tests, alpha) if has_baseline and parent else []
    tasks = client_tasks(client, rows)
    plots = [(f"{metric} per round", f"{metric}_per_round.png")]
    plot_rounds(rows, metric, out / plots[0][1])
    for key in dict.fromkeys([metric, "test_loss"]):
        if plot_heatmap(rows, key, out / f"{key}_per_client.png", tasks):
            plots.append((f"{key} per client", f"{key}_per_client.png"))
    if plot_communication(summary, metric, out / f"communication_vs_{metric}.png"):
        plots.append((f"communication against {metric}", f"communication_vs_{metric}.png"))
    for key in dict.fromkeys([metric, *also]):
        plots += [(p.stem, p.name) for p in plot_hyperparameters(rows, key, out, swept)]
    seeds = sorted({len(g) for g in by_label(rows).values()})
    lines = [f"# {experiment}: comparison", "",
             f"{len(rows)} runs, {len(labels)} methods, {'/'.join(map(str, seeds))} seed(s) each. Final-round values "
             f"with 95 % intervals: Student-t over seeds where a method has two or more seeds; with one seed a "
             f"percentile bootstrap over clients (10 000 resamples) of the example-weighted mean — it shows "
             f"client-to-client spread, not seed-to-seed. Test examples: summed over clients, per seed (accuracy · "
             f"test loss). MiB / round: bytes up + down of all sampled clients per round."
             + "".join(f" {k.replace('_', ' ')}: each run's last-round value." for k in also if k != metric), ""]
    if has_baseline:
        lines += [f"Each method is compared with **{baseline}** with the run as the unit: each run's mean over the "
                  f"clients both evaluated, paired by seed, a two-sided paired t test over the runs, p-values "
                  f"Holm-adjusted within each metric (the statistics of the reproduction cards and of the "
                  f"study's question). **Bold** marks (▲ better, ▼ worse than {baseline}) appear only where that "
                  f"difference is significant at α = {alpha}. Fewer than {vd.MIN_UNITS} runs a row, or runs without "
                  f"spread, give no p-value (undecided). Client-level differences are description only: the clients "
                  f"of a run share its aggregate, so they are not independent units.", ""]
    else:
        lines += [f"No run is labelled {baseline!r}: no paired tests (choose one with --baseline; methods: "
                  f"{', '.join(labels)}). Nothing is marked.", ""]
    lines += [table, ""]
    if asked:
        lines += ["## The question", "", *asked, ""]
    if has_baseline:
        lines += ["## What is significant", "", *found, "", "## Paired tests", "", tests_table(tests), ""]
    lines += ["## Plots", ""] + [f"![{title}]({name})\n" for title, name in plots]
    (out / "run_values.csv").write_text(run_values_csv(rows, tested))
    from fedsweep.provenance import git_commit

    lines += ["## Values", "", f"Every (run, client) final value of {', '.join(tested)} behind the tests: "
              f"[run_values.csv](run_values.csv) (a run's value is the mean over its clients). Code at commit "
              f"`{git_commit()}`.", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    if parent:
        for f in sorted(out.iterdir()):
            client.log_artifact(parent, str(f), "report")
        client.set_tag(parent, NOTE_TAG, study_note(lines, plots))
    return report, table, ([asked[0], *[x for x in asked[1:] if x]] if asked else []) + found


def run_values_csv(rows: list[RunRow], metrics: list[str]) -> str:
    """Every (method, seed, client) final value of ``metrics`` the tests took, one row each, with the run's
    MLflow id: the values behind the report, so its numbers can be recomputed outside the project."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "seed", "run_id", "client", "metric", "value"])
    for r in sorted(rows, key=lambda r: (r.label, r.seed)):
        for key in metrics:
            for cid, value in sorted(r.per_client.get(key, {}).items()):
                w.writerow([r.label, r.seed, r.run_id, cid, key, repr(float(value))])
    return buf.getvalue()


def _answer(client: MlflowClient, parent: str, tests: list[Test], alpha: float) -> list[str]:
    """The study's question (its parent run's ``fedsweep.question`` tag) answered from the very tests of
    the table (``reports.question``): one analysis, the run as the unit."""
    from fedsweep.reports.question import answer, from_tag

    question = from_tag(client.get_run(parent).data.tags)
    if not question:
        return []
    metric = question.get("metric", "test_loss")
    return answer(question, {t.label: t for t in tests if t.metric == metric}, alpha, better_of(metric) == "min")


def study_note(lines: list[str], plots: list[tuple[str, str]]) -> str:
    """The study run's description: the report up to its plots, which the note names as the run's
    artifacts (a note cannot show them inline). MLflow renders it as Markdown."""
    text = "\n".join(lines[:lines.index("## Plots")] if "## Plots" in lines else lines)
    names = ", ".join(f"`report/{name}`" for _, name in plots)
    return f"{text}\n## Plots\n\nIn this run's artifacts: {names}.\n"
