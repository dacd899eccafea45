"""``fedsweep tune SWEEP``: a Ray Tune study, one MLflow child run per trial, then the comparison report."""

from __future__ import annotations

import argparse
import time

from fedsweep.cli.views import console
from fedsweep.cli.views import print_report


def add(sub) -> None:
    p = sub.add_parser("tune", help="run a hyperparameter study (Ray Tune), one MLflow child run per trial")
    p.add_argument("sweep", help="sweep YAML (e.g. configs/sweeps/drift_delta.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of the base experiment (or of the sweep file with sweep.PATH=VALUE)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted study; finished trials are kept")
    p.add_argument("--no-report", action="store_true", help="skip the comparison report at the end")
    p.add_argument("--verbose", action="store_true",
                   help="Ray Tune's own status tables and the workers' output instead of the progress view")
    p.add_argument("--no-ideal", action="store_true",
                   help="skip the study's ideal at the end (its work at the best bare rates, measured after the "
                        "study on its first cell: seconds to half a minute on a CPU)")
    p.set_defaults(handler=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator import preflight
    from fedsweep.orchestrator.runtime import ray_runtime

    # Ray starts while the sweep and its trials' configs are validated and the study's modules imported
    # (worker output shown with --verbose)
    sweep, base = ray_runtime.start_while(preflight.load_study, args.sweep, args.overrides,
                                          log_to_driver=bool(args.verbose))
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient  # MLflow only through tracking.mlflow_api (preflight)

    from fedsweep.config.sweep import run_name, trial_count, trial_raw
    from fedsweep.orchestrator.tracking.ui import open_hint
    from fedsweep.orchestrator.study import study_dir, tune_study
    console.print(f"[dim]study {sweep.name}: {trial_count(sweep)} trials of {sweep.experiment}, "
                  f"metric {sweep.metric} ({sweep.mode}); MLflow at {sweep.tracking_uri}[/]")
    t0 = time.monotonic()
    results, parent = tune_study(sweep, base, resume=args.resume, verbose=1 if args.verbose else 0,
                                 progress=not args.verbose)
    wall = time.monotonic() - t0
    errors = len(results.errors)
    best = None
    try:
        best = results.get_best_result(metric=sweep.metric, mode=sweep.mode, filter_nan_and_inf=True)
    except Exception:
        pass
    if best is not None:
        console.print(f"best trial: {run_name(sweep, best.config, trial_raw(base, sweep, best.config))} → {sweep.metric} "
                      f"{best.metrics.get(sweep.metric, float('nan')):.4f}", highlight=False)
    if errors:
        console.print(f"[yellow]{errors} trial(s) failed; their errors are in {study_dir(sweep) / 'study.log'}[/]")
    if not args.no_ideal and not args.resume:  # (a resumed study's wall time is not the study's)
        _ideal(sweep, base, results, wall)
    if not args.no_report:
        print_report(sweep.name, sweep.tracking_uri, sweep.metric, also=tuple(sweep.report_metrics))
    experiment_id = MlflowClient(tracking_uri=sweep.tracking_uri).get_run(parent).info.experiment_id
    console.print(f"MLflow: study run {parent} in experiment '{sweep.name}'; "
                  f"{open_hint(sweep.tracking_uri, experiment_id)}", highlight=False, soft_wrap=True)
    return 1 if errors else 0


def _ideal(sweep, base, results, wall: float) -> None:
    """The study's wall time over its ideal (``bench.study_ideal``), printed and written beside the study."""
    import json

    import os

    from fedsweep.bench.study_ideal import study_ideal
    from fedsweep.config.sweep import trial_raw, validated
    from fedsweep.orchestrator.study import study_dir
    from fedsweep.plan.layout import Cluster
    from fedsweep.plan.resolve import resolve_layout

    trials = [r.metrics for r in results if r.metrics and "total/round_seconds" in r.metrics]
    if not trials:
        return
    first = {"variant": next(iter(sweep.variants or {"_": 0})), "seed": sweep.seeds[0],
             **{k: d.examples()[0] for k, d in sweep.space.items()}}
    cell, _ = resolve_layout(validated(trial_raw(base, sweep, first)), Cluster(cpus=float(os.cpu_count() or 1)))
    out = study_ideal(cell, trials, wall)
    path = study_dir(sweep) / "ideal.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    console.print(f"study: {wall:.0f} s against its ideal {out['ideal_s']:.0f} s ({out['trials']} trials, "
                  f"{out['trials_at_once']} at once): {out['over_ideal']:.2f}× → {path}", highlight=False)
