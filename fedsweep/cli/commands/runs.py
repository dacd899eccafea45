"""``fedsweep runs [--experiment NAME]``: the studies and runs in the MLflow store, without opening MLflow."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import console

STATUS_STYLE = {"FINISHED": "green", "RUNNING": "yellow", "FAILED": "red", "KILLED": "red"}


def add(sub) -> None:
    p = sub.add_parser("runs", help="list the studies and runs in the MLflow store (status, rounds, metric, checkpoints)")
    p.add_argument("--experiment", help="only this MLflow experiment (a study's or a config's name)")
    p.add_argument("--uri", default=None, help="MLflow tracking URI (default sqlite:///results/mlflow.db; with "
                   "--sync, the store the outboxes keep unless given)")
    p.add_argument("--limit", type=int, default=50, help="newest runs to list (default 50)")
    p.add_argument("--sync", action="store_true",
                   help="first send the tracking records that wait in the runs' outboxes below --root (written "
                        "while a tracking server did not answer), then list")
    p.add_argument("--root", default="results", help="where --sync looks for outboxes (default results)")
    p.set_defaults(handler=cmd_runs)


def cmd_runs(args: argparse.Namespace) -> int:
    from rich.table import Table

    from fedsweep.errors import ConfigError
    from fedsweep.reports.run_index import collect
    from fedsweep.storage import sqlite_file, without_userinfo

    if args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}")
    if args.sync:
        from pathlib import Path

        from fedsweep.orchestrator.tracking.outbox import outboxes, sync

        if not outboxes(Path(args.root)):
            console.print(f"no tracking records wait below {args.root}")
        else:
            got = sync(Path(args.root), lambda line: console.print(f"[dim]{line}[/]", highlight=False), uri=args.uri)
            notes = [f"{got['refused']} refused by the server (kept as .refused.json)" if got["refused"] else "",
                     f"{got['waiting']} still wait (the server does not answer)" if got["waiting"] else "",
                     f"{got['busy']} outbox(es) of live runs left to them" if got["busy"] else "",
                     f"{got['other_store']} outbox(es) for another store not sent" if got["other_store"] else ""]
            console.print(f"sent {got['sent']} tracking record(s)" + "".join(f"; {n}" for n in notes if n))
    args.uri = args.uri or "sqlite:///results/mlflow.db"
    _end_abandoned(args.root, args.uri)
    shown = without_userinfo(args.uri)
    db = sqlite_file(args.uri)
    if db is not None and not db.exists():  # MLflow would create an empty store there
        raise ConfigError(f"no MLflow store at {shown}: run a study or an experiment first (make demo)")
    try:
        studies, runs = collect(args.uri, args.experiment, args.limit)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not studies and not runs:
        console.print(f"no runs in {shown}")
        return 0
    if studies:
        table = Table(title=f"studies in {shown}", title_justify="left")
        for col in ("experiment", "study", "status", "trials", "best", "folder"):
            table.add_column(col, overflow="fold")
        for s in studies:
            style = STATUS_STYLE.get(s.status, "")
            table.add_row(s.experiment, s.name, f"[{style}]{s.status}[/]" if style else s.status,
                          f"{s.trials_finished}/{s.trials}", s.best, s.where)
        console.print(table)
    if runs:
        table = Table(title=f"runs in {shown} (newest first)", title_justify="left")
        for col in ("experiment", "run", "method", "status", "rounds", "final", "checkpoints"):
            table.add_column(col, overflow="fold")
        for r in runs:
            style = STATUS_STYLE.get(r.status, "")
            rounds = "—" if r.rounds_done is None else f"{r.rounds_done}/{r.rounds}" if r.rounds else str(r.rounds_done)
            table.add_row(r.experiment, r.name, r.method, f"[{style}]{r.status}[/]" if style else r.status, rounds,
                          r.final, r.checkpoints)
        console.print(table)
    console.print(f"[dim]continue a study with fedsweep tune SWEEP --resume, a run with fedsweep run CONFIG --resume; "
                  f"compare with fedsweep compare --experiment NAME --uri {shown}[/]", soft_wrap=True)
    return 0


def _end_abandoned(root: str, given: str) -> None:
    """Runs below ``root`` whose driver is gone without ending them, ended KILLED (``run_dirs.abandoned``;
    a store that does not answer now is tried again by the next command)."""
    from pathlib import Path

    from fedsweep.orchestrator.run_dirs import abandoned
    from fedsweep.storage import without_userinfo

    def mark(run_id: str, info: dict) -> None:
        uri = ((info.get("config") or {}).get("tracking") or {}).get("uri")
        if not uri:
            return
        from fedsweep.orchestrator.tracking.tracker import end_abandoned

        if end_abandoned(given if without_userinfo(given) == uri else uri, run_id):  # (run.json keeps no credentials)
            console.print(f"[dim]run {run_id}: its driver is gone without ending it: marked KILLED[/]")

    abandoned(Path(root), mark)
