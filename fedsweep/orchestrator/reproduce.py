"""``fedsweep reproduce NAME``: run a reproduction card's study and judge its pre-registered hypotheses.

The card's study for the chosen budget runs as any study does (``orchestrator.study``: one MLflow
child run per trial under a parent run), in the MLflow experiment ``reproduce-NAME-BUDGET-vN``.
Then every hypothesis is judged from the trials' final per-client metrics
(``orchestrator.reports.verdicts``) and the card report is written — the paper's figure, ours with
its 95 % interval, p and Holm p, the verdict, the effect this budget could have detected — to
``results/reproductions/NAME/BUDGET-vN.md`` and logged to the study's parent run.

Pairing: a paired hypothesis pairs a treatment value with the baseline value of the same seed and
client *only where both rows' clients hold the same data* (the runs' data and partition parameters
agree); rows on different data are refused for pairing, in one line (a card compares them with
``paired: false``).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

from fedsweep.config.card import Card
from fedsweep.errors import ConfigError
from fedsweep.orchestrator.reports import verdicts as vd
from fedsweep.orchestrator.reports.pairing import data_signature

@dataclass
class RowValues:
    """A study row's final per-client values of one metric: {(seed, client): value}, with each seed's
    data signature, and the run-level values (one per trial)."""

    per_client: dict[tuple[str, int], float]
    signatures: dict[str, tuple]
    per_run: dict[str, float]
    """Each trial's own (run-level) value, by seed."""


def row_values(rows, label: str, metric: str) -> RowValues:
    per_client: dict[tuple[str, int], float] = {}
    signatures: dict[str, tuple] = {}
    per_run: dict[str, float] = {}
    for r in rows:
        if r.label != label:
            continue
        signatures[r.seed] = data_signature(r.params)
        for cid, value in r.per_client.get(metric, {}).items():
            if not math.isnan(value):
                per_client[(r.seed, cid)] = value
        run_value = r.final.get(metric)
        if run_value is None:
            run_value = r.run_metrics.get(metric) if hasattr(r, "run_metrics") else None
        if run_value is not None and not math.isnan(run_value):
            per_run[r.seed] = run_value
    return RowValues(per_client, signatures, per_run)


def paired_values(treatment: RowValues, baseline: RowValues, what: str) -> tuple[list[float], list[float]]:
    """Values of the (seed, client) pairs both rows evaluated, refused where a seed's data differ."""
    for seed, sig in treatment.signatures.items():
        other = baseline.signatures.get(seed)
        if other is not None and other != sig:
            diff = sorted(set(sig) ^ set(other))
            raise ConfigError(f"{what}: the two rows' clients hold different data at seed {seed} "
                              f"({', '.join(f'{k}={v}' for k, v in diff[:4])}): a paired test would pair "
                              f"clients that do not share a test set; compare them with paired: false")
    keys = sorted(set(treatment.per_client) & set(baseline.per_client))
    return [treatment.per_client[k] for k in keys], [baseline.per_client[k] for k in keys]


def judge(card: Card, rows) -> list[vd.Outcome]:
    """Every hypothesis of ``card`` judged on the study's ``rows`` (``reports.compare.RunRow``)."""
    outcomes, diffs, values, bounds, higher = [], {}, {}, {}, {}
    for h in card.hypotheses:
        t = row_values(rows, h.treatment, h.metric)
        if h.kind in ("at_least", "at_most"):
            if h.ratio and h.unit == "client":  # the baseline's value over the treatment's, client by client
                b_vals, t_vals = paired_values(row_values(rows, h.baseline, h.metric), t,
                                               f"hypothesis {h.id} ({h.baseline} over {h.treatment})")
                x = np.asarray([bv / tv for bv, tv in zip(b_vals, t_vals) if tv], dtype=float)
            elif h.ratio:  # the baseline's value over the treatment's, seed by seed
                b = row_values(rows, h.baseline, h.metric)
                seeds = sorted(set(t.per_run) & set(b.per_run))
                x = np.asarray([b.per_run[s] / t.per_run[s] for s in seeds if t.per_run[s]], dtype=float)
            elif h.unit == "client":
                x = np.asarray(list(t.per_client.values()), dtype=float)
            else:
                x = np.asarray(list(t.per_run.values()), dtype=float)
            outcomes.append(vd.threshold(h.id, h.kind, x, h.bound))
            values[h.id], bounds[h.id] = x, h.bound
            continue
        b = row_values(rows, h.baseline, h.metric)
        higher[h.id] = h.better_high()
        if h.paired:
            a, c = paired_values(t, b, f"hypothesis {h.id} ({h.treatment} vs {h.baseline})")
            out = vd.paired(h.id, h.kind, a, c, h.margin, higher[h.id])
            diffs[h.id] = np.asarray(a, dtype=float) - np.asarray(c, dtype=float)
        else:
            out = vd.unpaired(h.id, h.kind, list(t.per_client.values()), list(b.per_client.values()))
            diffs[h.id] = (np.asarray(list(t.per_client.values())), np.asarray(list(b.per_client.values())))
        bounds[h.id] = h.margin
        outcomes.append(out)
    return vd.decide(outcomes, diffs, values, bounds, card.alpha, higher)


def _fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.4g}"


def report(card: Card, budget: str, outcomes: list[vd.Outcome], minutes: float | None, command: str) -> str:
    """The card report in Markdown: one row per hypothesis, then the pre-registration it tested."""
    b = card.budgets[budget]
    lines = [f"# Reproduction card: {card.card} (version {card.version}, {budget} budget)", "",
             f"Paper: *{card.paper}*. Hypotheses registered {card.registered}; test: Wilcoxon signed-rank over "
             f"client × seed pairs (Mann–Whitney where a hypothesis compares rows on different data), Holm within "
             f"the card, α = {card.alpha}.", "",
             f"Command: `{command}`" + (f" — {minutes:.1f} min on this machine." if minutes else ""), "",
             "| hypothesis | paper | ours: estimate [95 % CI] | pairs | p | p (Holm) | verdict | detectable effect (80 % power) |",
             "|---|---|---|---|---|---|---|---|"]
    by_id = {h.id: h for h in card.hypotheses}
    for o in outcomes:
        h = by_id[o.id]
        what = ("baseline / treatment" if h.ratio else "treatment − baseline") if h.baseline else "value"
        if h.unit == "client" and h.kind in ("at_least", "at_most"):
            what += ", per client"
        est = f"{_fmt(o.estimate)} [{_fmt(o.low)}, {_fmt(o.high)}] ({what}, {h.metric})"
        mde = _fmt(o.mde) if o.mde is not None else ""
        lines.append(f"| {h.id}: {h.claim} | {h.paper} | {est} | {o.n} | {_fmt(o.p)} | {_fmt(o.p_holm)} | "
                     f"**{o.verdict}** | {mde} |")
    lines += ["", "## How this budget differs from the paper", "", b.differs, "",
              "## The study", ""] + ([f"The sweep file `{b.sweep}` (relative to the card), as run:", ""] if b.sweep else []) + \
        ["```yaml", yaml.safe_dump(b.study, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def study_file(card: Card, budget: str, card_path: Path, directory: Path) -> Path:
    """The budget's study as a sweep file (``fedsweep tune``'s format) the study runner reads."""
    study = dict(card.budgets[budget].study)
    exp = Path(study["experiment"])
    if not exp.is_absolute():
        exp = (card_path.parent / exp).resolve()
    paired = [h for h in card.hypotheses if h.kind in ("greater", "less", "not_worse")]
    first = paired[0] if paired else None  # the study's own metric: one every trial reports
    metric = first.metric if first else "test_loss"
    raw = {"name": card.study_name(budget), **study, "experiment": str(exp),
           "metric": metric, "mode": "max" if first and first.better_high() else "min"}
    path = directory / f"{card.study_name(budget)}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_card(name: str, budget: str, overrides: list[str], say: Callable[[str], None],
             resume: bool = False, out_dir: str = "results/reproductions") -> tuple[Card, list[vd.Outcome], Path]:
    """Run ``name``'s study at ``budget`` (a local Ray runtime or the cluster ``RAY_ADDRESS`` names),
    judge it, write and log the report; (card, outcomes, report path)."""
    from fedsweep.config.card import load_card
    from fedsweep.config.sweep import trial_count
    from fedsweep.orchestrator.runtime import ray_runtime
    from fedsweep.orchestrator.study import tune_study

    card, path = load_card(name)
    if budget not in card.budgets:
        raise ConfigError(f"card {card.card} has no {budget} budget (it has {', '.join(card.budgets)})")
    with tempfile.TemporaryDirectory() as tmp:
        sweep_path = study_file(card, budget, path, Path(tmp))
        sweep, base = ray_runtime.start_while(lambda: _load(sweep_path, overrides), log_to_driver=False)
        say(f"card {card.card} v{card.version} ({budget}): {len(card.hypotheses)} hypotheses, "
            f"{trial_count(sweep)} trials; MLflow experiment {sweep.name} at {sweep.tracking_uri}")
        t0 = time.perf_counter()
        _, parent = tune_study(sweep, base, resume=resume, verbose=0, progress=True)
        minutes = (time.perf_counter() - t0) / 60
    outcomes, out = conclude(card, budget, sweep, parent, minutes, out_dir)
    return card, outcomes, out


def check_card(name: str, budget: str, overrides: list[str]) -> str:
    """Validate ``name``'s study at ``budget`` — every trial's config, and its data and partition —
    without running it; one line that says what would run."""
    from fedsweep.config.card import load_card
    from fedsweep.config.sweep import trial_count, trial_raw, validated
    from fedsweep.orchestrator.experiment_data import prepare_data

    card, path = load_card(name)
    if budget not in card.budgets:
        raise ConfigError(f"card {card.card} has no {budget} budget (it has {', '.join(card.budgets)})")
    with tempfile.TemporaryDirectory() as tmp:
        sweep, base = _load(study_file(card, budget, path, Path(tmp)), overrides)
        for variant in sweep.variants or {}:
            for seed in sweep.seeds:
                prepare_data(validated(trial_raw(base, sweep, {"variant": variant, "seed": seed})))
    return (f"ok: card {card.card} v{card.version} ({budget}) — {len(card.hypotheses)} hypotheses, "
            f"{trial_count(sweep)} trials of {Path(sweep.experiment).name}")


def conclude(card: Card, budget: str, sweep, parent: str, minutes: float | None,
             out_dir: str = "results/reproductions") -> tuple[list[vd.Outcome], Path]:
    """Judge the card's hypotheses on its finished study, write the report under ``out_dir`` and log it,
    with each verdict as a tag, to the study's parent run."""
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    rows = _rows(client, sweep.name, card)
    outcomes = judge(card, rows)
    command = f"fedsweep reproduce {card.card} --budget {budget}"
    text = report(card, budget, outcomes, minutes, command)
    out = Path(out_dir) / card.card / f"{budget}-v{card.version}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    client.log_text(parent, text, "reproduction.md")
    for o in outcomes:
        client.set_tag(parent, f"fedsweep.verdict.{o.id}", o.verdict)
    client.set_tag(parent, "fedsweep.card", f"{card.card} v{card.version} {budget}")
    if minutes is not None:
        client.log_metric(parent, "minutes", minutes)
    return outcomes, out


def _load(sweep_path: Path, overrides: list[str]):
    from fedsweep.config.sweep import load_sweep
    from fedsweep.orchestrator.preflight import prepare_store_soon

    sweep, base = load_sweep(sweep_path, overrides)
    prepare_store_soon(sweep.tracking_uri)
    return sweep, base


def _rows(client, experiment: str, card: Card):
    """The newest study's finished trials with every metric the hypotheses name."""
    from fedsweep.orchestrator.reports.compare import collect

    rows, _ = collect(client, experiment, "round")  # every trial logs its rounds
    extra = {h.metric for h in card.hypotheses}
    by_client = {h.metric for h in card.hypotheses if h.unit == "client"}
    for r in rows:  # per-client values of metrics beyond the first, and run-level final values
        r.run_metrics = dict(client.get_run(r.run_id).data.metrics)
        for key, value in r.run_metrics.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "client" and parts[1].isdigit() and parts[2] in extra:
                r.per_client.setdefault(parts[2], {})[int(parts[1])] = value
        for key in extra:
            if key in r.run_metrics:
                r.final.setdefault(key, r.run_metrics[key])
        if "bytes_per_round" in by_client:  # each client's bytes up + down, averaged over the rounds
            r.per_client["bytes_per_round"] = _client_bytes(client, r)
    return rows


def _client_bytes(client, row) -> dict[int, float]:
    """Each client's bytes up + down per round, averaged over the rounds (from the per-round histories
    of the clients ``collect`` found with ``bytes_up``)."""
    from fedsweep.orchestrator.reports.compare import _history

    out: dict[int, float] = {}
    for cid in row.per_client.get("bytes_up", {}):
        per_round: dict[int, float] = {}
        for name in ("bytes_up", "bytes_down"):
            for step, value in _history(client, row.run_id, f"client/{cid:03d}/{name}").items():
                per_round[step] = per_round.get(step, 0.0) + value
        if per_round:
            out[cid] = float(np.mean(list(per_round.values())))
    return out
