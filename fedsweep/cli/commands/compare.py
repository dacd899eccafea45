"""``fedsweep compare --experiment NAME``: the comparison report (Markdown table, intervals, plots) from MLflow."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import print_report


def add(sub) -> None:
    p = sub.add_parser("compare", help="comparison report of an MLflow experiment: Markdown table and plots")
    p.add_argument("--experiment", required=True, help="MLflow experiment name (a study's or a config's name)")
    p.add_argument("--uri", default="sqlite:///results/mlflow.db", help="MLflow tracking URI")
    p.add_argument("--metric", default="accuracy", help="metric to compare (default accuracy)")
    p.add_argument("--out", default="results/reports", help="output folder (a subfolder per experiment)")
    p.add_argument("--all-runs", action="store_true",
                   help="every finished run of the experiment (default: the newest study's trials, if any)")
    p.add_argument("--baseline", default="fedavg",
                   help="method every other is tested against (paired t over runs, the seed as the unit; default fedavg)")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="significance level for the bold marks and the report's statements (default 0.05)")
    p.add_argument("--also", action="append", default=[], metavar="METRIC",
                   help="a run-level metric shown as a column beside --metric, its last-round value "
                        "(repeatable; e.g. --also drift_neighbours_mean)")
    p.set_defaults(handler=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    print_report(args.experiment, args.uri, args.metric, args.out, args.all_runs, args.baseline, args.alpha, tuple(args.also))
    return 0
