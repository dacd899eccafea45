"""``fedsweep reproduce NAME``: run a reproduction card's study and judge its pre-registered hypotheses.

The card's study for the chosen budget runs as any study does (``orchestrator.study``: one MLflow
child run per trial under a parent run), in the MLflow experiment ``reproduce-NAME-BUDGET-vN``.
Then every hypothesis is judged from the trials' final per-client metrics with the run (seed) as the
unit (``reports.card_units``, ``reports.verdicts``) and the card report is written — the paper's
figure, ours with its 95 % interval, the test, unit, n, p and Holm p, the decision interval, the
verdict, the effect this budget could have detected, and its provenance — to
``results/reproductions/NAME/BUDGET-vN.md``, with the values it tested in ``BUDGET-vN.csv``
(``fedsweep reproduce --verify`` recomputes the verdicts from them) and their figure in
``BUDGET-vN.png`` (``reports.card_figure``), and logged to the study's parent run.

Pairing: a paired hypothesis pairs the runs of the same seed *only where both rows' clients hold the
same data* (the runs' data and partition parameters agree); rows on different data are refused for
pairing, in one line (a card compares them with ``paired: false``).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

from fedsweep.config.card import Card
from fedsweep.errors import ConfigError
from fedsweep.reproduce import card_figure, card_report
from fedsweep.reports import verdicts as vd
from fedsweep.reproduce.card_units import group, judge, run_level, to_csv


@dataclass(frozen=True)
class Outside:
    """A replication run outside the project (``--replicate --seeds … --label …``): the registered design
    on seeds its runner chose (``config.card.OUTSIDE_SEEDS_FROM`` up), named by its label."""

    seeds: tuple[int, ...]
    label: str


def suffix(replication: bool, outside: Outside | None = None) -> str:
    """What a study's and a report's name carry: ``-replication`` (the card's declared seeds),
    ``-replication-LABEL`` (outside the project) or nothing."""
    return f"-replication-{outside.label}" if outside else "-replication" if replication else ""


def study_file(card: Card, budget: str, card_path: Path, directory: Path, pilot: bool = False,
               replication: bool = False, outside: Outside | None = None) -> Path:
    """The budget's study as a sweep file (``fedsweep tune``'s format) the study runner reads; ``pilot``:
    the same study on the pilot's seeds (``config.card.PILOT_SEEDS``), named ``…-pilot``; ``replication``:
    on the budget's ``replication_seeds``, named ``…-replication``; ``outside``: on its seeds, named
    ``…-replication-LABEL``."""
    from fedsweep.config.card import PILOT_SEEDS

    study = dict(card.budgets[budget].study)
    exp = Path(study["experiment"])
    if not exp.is_absolute():
        exp = (card_path.parent / exp).resolve()
    paired = [h for h in card.hypotheses if h.kind in ("greater", "less", "not_worse")]
    first = paired[0] if paired else None  # the study's own metric: one every trial reports
    metric = first.metric if first else "test_loss"
    name = card.study_name(budget) + ("-pilot" if pilot else suffix(replication, outside))
    raw = {"name": name, **study, "experiment": str(exp),
           "metric": metric, "mode": "max" if first and first.better_high() else "min"}
    if pilot:
        raw["seeds"] = list(PILOT_SEEDS)
    if outside:
        raw["seeds"] = list(outside.seeds)
    elif replication:
        seeds = card.budgets[budget].replication_seeds
        if not seeds:
            raise ConfigError(f"card {card.card} v{card.version} declares no replication_seeds for its {budget} "
                              f"budget: a replication runs a seed block the card declared before it ran")
        raw["seeds"] = list(seeds)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _budget_of(name: str, budget: str):
    from fedsweep.config.card import load_card

    card, path = load_card(name)
    if budget not in card.budgets:
        raise ConfigError(f"card {card.card} has no {budget} budget (it has {', '.join(card.budgets)})")
    return card, path


def _run_study(card: Card, budget: str, path: Path, overrides: list[str], say: Callable[[str], None],
               resume: bool, pilot: bool, replication: bool = False, outside: Outside | None = None):
    """Run the card's study (or its pilot, or its replication); (sweep, parent run id, minutes)."""
    from fedsweep.config.sweep import trial_count
    from fedsweep.orchestrator.runtime import ray_runtime
    from fedsweep.orchestrator.study import tune_study

    with tempfile.TemporaryDirectory() as tmp:
        sweep_path = study_file(card, budget, path, Path(tmp), pilot=pilot, replication=replication, outside=outside)
        sweep, base = ray_runtime.start_while(lambda: _load(sweep_path, overrides), log_to_driver=False)
        what = ", pilot" if pilot else f", replication outside the project ({outside.label})" if outside else \
            ", replication" if replication else ""
        say(f"card {card.card} v{card.version} ({budget}{what}): {len(card.hypotheses)} "
            f"hypotheses, {trial_count(sweep)} trials; MLflow experiment {sweep.name} at {sweep.tracking_uri}")
        t0 = time.perf_counter()
        _, parent = tune_study(sweep, base, resume=resume, verbose=0, progress=True)
        return sweep, parent, (time.perf_counter() - t0) / 60


def run_card(name: str, budget: str, overrides: list[str], say: Callable[[str], None],
             resume: bool = False, out_dir: str = "results/reproductions",
             replication: bool = False, outside: Outside | None = None) -> tuple[Card, list[vd.Outcome], Path]:
    """Run ``name``'s study at ``budget`` (a local Ray runtime or the cluster ``RAY_ADDRESS`` names),
    judge it, write and log the report; ``replication``: the same design on the card's declared fresh
    seeds, written as ``BUDGET-vN-replication.md``; ``outside``: the same design on seeds someone outside
    the project chose, written as ``BUDGET-vN-replication-LABEL.md``; (card, outcomes, report path)."""
    card, path = _budget_of(name, budget)
    replication = replication or outside is not None
    if replication and overrides:
        raise ConfigError("--replicate runs the registered design unchanged: no --set")
    if outside is not None:
        problem = card.outside_seeds_problem(budget, list(outside.seeds), outside.label)
        if problem:
            raise ConfigError(problem)
    sweep, parent, minutes = _run_study(card, budget, path, overrides, say, resume, pilot=False,
                                        replication=replication, outside=outside)
    outcomes, out = conclude(card, budget, sweep, parent, minutes, out_dir, path, replication, outside)
    if budget == "cpu" and not overrides:
        record_fingerprint(card.card, say)
    return card, outcomes, out


def record_fingerprint(name: str, say: Callable[[str], None]) -> Path | None:
    """The card's numerics fingerprint at the report's commit, recorded beside the committed reports
    (``reproductions/NAME/fingerprints.json.gz``), unless that commit already has one or the checkout
    differs from its commit (a report of uncommitted code is stale whatever its fingerprint)."""
    from fedsweep.provenance import git_commit
    from fedsweep.reproduce import fingerprint

    commit = git_commit()
    if commit.endswith("+dirty") or commit == "unknown":
        say(f"no fingerprint recorded: the checkout is {commit}")
        return None
    if commit in fingerprint.stored(name):
        return fingerprint.store_path(name)
    say(f"{name}: its numerics fingerprint at {commit[:12]} (a short trial per arm)")
    return fingerprint.store(name, fingerprint.collect([name], say=say)[name])


def run_pilot(name: str, budget: str, overrides: list[str], say: Callable[[str], None],
              resume: bool = False, out_dir: str = "results/reproductions") -> tuple[Card, dict, Path]:
    """Run ``name``'s pilot at ``budget`` (``reports.pilot``): its study on the pilot's seeds, then each
    hypothesis's spread and the runs its named effect needs, written to ``BUDGET-vN-pilot.json``;
    (card, the pilot, its path)."""
    import json

    from fedsweep.reproduce import card_report, pilot
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    card, path = _budget_of(name, budget)
    sweep, parent, minutes = _run_study(card, budget, path, overrides, say, resume, pilot=True)
    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    _, units = judge(card, _rows(client, sweep.name, card))
    runs = [r for rows in group(units).values() for r in run_level(rows)]
    result = {"card": card.card, "version": card.version, "budget": budget, "seeds": list(pilot.PILOT_SEEDS),
              "minutes": round(minutes, 1), "provenance": card_report.provenance(path, [Path(sweep.experiment)]),
              **pilot.plan(card, runs, len(card.budgets[budget].study.get("seeds") or []))}
    out = Path(out_dir) / card.card / f"{budget}-v{card.version}-pilot.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    client.log_text(parent, out.read_text(), "pilot.json")
    return card, result, out


def check_card(name: str, budget: str, overrides: list[str]) -> str:
    """Validate ``name``'s study at ``budget`` — every trial's config, and its data and partition —
    without running it; one line that says what would run."""
    from fedsweep.config.sweep import trial_count, trial_raw, validated
    from fedsweep.orchestrator.experiment_data import prepare_data

    card, path = _budget_of(name, budget)
    with tempfile.TemporaryDirectory() as tmp:
        sweep, base = _load(study_file(card, budget, path, Path(tmp)), overrides)
        for variant in sweep.variants or {}:
            for seed in sweep.seeds:
                prepare_data(validated(trial_raw(base, sweep, {"variant": variant, "seed": seed})))
    short = [h.id for h in card.hypotheses if h.kind in ("at_least", "at_most") and len(sweep.seeds) < vd.MIN_UNITS]
    warn = (f"; cannot decide {', '.join(short)}: a threshold needs {vd.MIN_UNITS} runs, the study has "
            f"{len(sweep.seeds)} seeds (a new card version must add seeds)") if short else ""
    return (f"ok: card {card.card} v{card.version} ({budget}) — {len(card.hypotheses)} hypotheses, "
            f"{trial_count(sweep)} trials of {Path(sweep.experiment).name}, {len(sweep.seeds)} runs a row{warn}")


def conclude(card: Card, budget: str, sweep, parent: str, minutes: float | None,
             out_dir: str = "results/reproductions", card_path: Path | None = None,
             replication: bool = False, outside: Outside | None = None) -> tuple[list[vd.Outcome], Path]:
    """Judge the card's hypotheses on its finished study (the run as the unit), write the report and the
    CSV of the values it tested under ``out_dir``, and log both, with each verdict as a tag, to the
    study's parent run."""
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    client = MlflowClient(tracking_uri=sweep.tracking_uri)
    rows = _rows(client, sweep.name, card)
    outcomes, units = judge(card, rows)
    command = f"fedsweep reproduce {card.card} --budget {budget}" + (" --replicate" if replication else "") + \
        (f" --seeds {','.join(map(str, outside.seeds))} --label {outside.label}" if outside else "")
    path = card_path or card._source
    configs = [Path(sweep.experiment)] + ([path.parent / card.budgets[budget].sweep] if card.budgets[budget].sweep else [])
    text = card_report.report(card, budget, outcomes, minutes, command, card_report.provenance(path, configs),
                              replication, sorted({str(r.seed) for r in rows}), outside.label if outside else None)
    out = Path(out_dir) / card.card / f"{budget}-v{card.version}{suffix(replication, outside)}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".csv").write_text(to_csv(units))
    figure = card_figure.draw_report(out, card)
    client.log_text(parent, text, "reproduction.md")
    client.log_text(parent, to_csv(units), "reproduction.csv")
    client.log_artifact(parent, str(figure))
    for o in outcomes:
        client.set_tag(parent, f"fedsweep.verdict.{o.id}", o.verdict)
    client.set_tag(parent, "fedsweep.card", f"{card.card} v{card.version} {budget}" + suffix(replication, outside).replace("-", " ", 1))
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
    from fedsweep.reports.compare import collect

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
    from fedsweep.reports.compare import _history

    out: dict[int, float] = {}
    for cid in row.per_client.get("bytes_up", {}):
        per_round: dict[int, float] = {}
        for name in ("bytes_up", "bytes_down"):
            for step, value in _history(client, row.run_id, f"client/{cid:03d}/{name}").items():
                per_round[step] = per_round.get(step, 0.0) + value
        if per_round:
            out[cid] = float(np.mean(list(per_round.values())))
    return out
