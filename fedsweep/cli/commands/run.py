"""``fedsweep run CONFIG [--set path=value ...] [--resume]``: one experiment, tracked and checkpointed."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import add_config_args, console
from fedsweep.cli.views import RunView, summary_table


def add(sub) -> None:
    p = sub.add_parser("run", help="run one experiment (tracked in MLflow, checkpointed every round)")
    add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue the latest run of this config from its last complete round")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator import preflight
    from fedsweep.orchestrator.runtime import ray_runtime

    if args.resume:  # the run it continues checked before Ray starts: a refused resume starts nothing
        cfg = preflight.load_experiment(args.config, args.overrides, resume=True)
    else:
        cfg = ray_runtime.start_while(preflight.load_experiment, args.config, args.overrides)  # validated as Ray starts
    from fedsweep.orchestrator.runner import run

    view = RunView(enabled=not args.quiet)
    try:
        outcome = run(cfg, resume=args.resume, on_event=view)
    finally:
        view.stop()
    console.print(summary_table(outcome))
    rounds = outcome.rounds
    if rounds:
        secs = [r["metrics"]["round_seconds"] for r in rounds]
        evals = [r["metrics"].get("eval_seconds", 0.0) for r in rounds]
        console.print(f"rounds {rounds[0]['round']}–{rounds[-1]['round']}: {sum(secs):.1f}s "
                      f"({sum(secs) / len(secs):.1f}s per round, of which evaluation {sum(evals) / len(evals):.1f}s); "
                      f"checkpoints in {outcome.run_dir / 'checkpoints'}")
    report_tracking(outcome, cfg.tracking.experiment or cfg.name)
    return 0


def report_tracking(outcome, experiment: str) -> None:
    """Where the run is in MLflow and how to open it; where the server does not answer (the run trained,
    its records wait in the outbox), that instead, and how to send them."""
    if not outcome.tracking_uri:
        return
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient  # MLflow only through tracking.mlflow_api (preflight)
    from fedsweep.orchestrator.tracking.ui import open_hint

    try:
        if not outcome.run_id or outcome.tracking_left:
            raise ConnectionError("records wait")
        experiment_id = MlflowClient(tracking_uri=outcome.tracking_uri).get_run(outcome.run_id).info.experiment_id
    except Exception:  # noqa: BLE001  (the server away: training is done, only tracking waits)
        console.print(f"[yellow]tracking[/]: the server at {outcome.tracking_uri} has not taken every record yet "
                      f"({outcome.tracking_left or 'some'} wait in {outcome.run_dir}); send them when it is back "
                      f"with: fedsweep runs --sync --root {outcome.run_dir}", highlight=False, soft_wrap=True)
        return
    console.print(f"MLflow run [bold]{outcome.run_id}[/] in experiment '{experiment}' at {outcome.tracking_uri}")
    console.print("  " + open_hint(outcome.tracking_uri, experiment_id), highlight=False, soft_wrap=True)
