"""``fedsweep tune SWEEP``: a Ray Tune study, one MLflow child run per trial, then the comparison report."""

from __future__ import annotations

import argparse

from fedsweep.orchestrator.views import console
from fedsweep.orchestrator.views import print_report


def add(sub) -> None:
    p = sub.add_parser("tune", help="run a hyperparameter study (Ray Tune), one MLflow child run per trial")
    p.add_argument("sweep", help="sweep YAML (e.g. configs/sweeps/drift_delta.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of the base experiment (or of the sweep file with sweep.PATH=VALUE)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted study; finished trials are kept")
    p.add_argument("--no-report", action="store_true", help="skip the comparison report at the end")
    p.set_defaults(handler=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from fedsweep.config.sweep import load_sweep, trial_count
    from fedsweep.orchestrator.study import tune_study

    sweep, base = load_sweep(args.sweep, args.overrides)
    console.print(f"[dim]study {sweep.name}: {trial_count(sweep)} trials of {sweep.experiment}, "
                  f"metric {sweep.metric} ({sweep.mode}); MLflow at {sweep.tracking_uri}[/]")
    results, parent = tune_study(sweep, base, resume=args.resume)
    errors = len(results.errors)
    best = None
    try:
        best = results.get_best_result(metric=sweep.metric, mode=sweep.mode, filter_nan_and_inf=True)
    except Exception:
        pass
    if best is not None:
        console.print(f"best trial: {best.config} → {sweep.metric} {best.metrics.get(sweep.metric, float('nan')):.4f}")
    if errors:
        console.print(f"[yellow]{errors} trial(s) failed; see {results.experiment_path}[/]")
    if not args.no_report:
        print_report(sweep.name, sweep.tracking_uri, sweep.metric)
    console.print(f"MLflow parent run {parent} in experiment '{sweep.name}'; open it with: "
                  f"mlflow ui --backend-store-uri {sweep.tracking_uri}")
    return 1 if errors else 0
