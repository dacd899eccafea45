"""The ``fedsweep`` command.

    fedsweep run CONFIG [--set path=value ...] [--resume]   run one experiment
    fedsweep validate CONFIG [--set path=value ...]         check config and data, start nothing
    fedsweep algorithms                                     list methods and their hyperparameters

Errors in config, data or model end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(stderr=False)
err = Console(stderr=True)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="experiment YAML (e.g. configs/experiments/smoke.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set clients.num_clients=8 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsweep", description="Federated fine-tuning of LLMs on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run one experiment (tracked in MLflow, checkpointed every round)")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue the latest run of this config from its last complete round")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("validate", help="validate a config and its data; starts nothing")
    _add_config_args(p)
    sub.add_parser("algorithms", help="list registered methods with their hyperparameters and defaults")
    return parser


# ------------------------------------------------------------------------- commands


def cmd_algorithms(_: argparse.Namespace) -> int:
    from fedsweep.algorithms import registry

    table = Table(title="fedsweep algorithms", show_lines=False)
    for col in ("name", "kind", "hyperparameters (default)", "summary"):
        table.add_column(col)
    for name in registry.names():
        cls = registry.get(name)
        fields = cls.Params.model_fields
        hp = ", ".join(f"{k}={f.default!r}" for k, f in fields.items()) or "—"
        table.add_row(name, "personalised" if cls.personalized else "global", hp, cls.summary)
    console.print(table)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator.runner import validate_file

    cfg, clients = validate_file(args.config, args.overrides)
    sizes = [len(c.train) for c in clients]
    console.print(f"[green]ok[/]: {args.config} — {cfg.algorithm}, {cfg.clients.num_clients} clients "
                  f"({cfg.num_actors} actors), {cfg.rounds} rounds, model {cfg.model.name}, "
                  f"{cfg.partition.scheme} split: {min(sizes)}–{max(sizes)} train examples per client")
    return 0


class RunView:
    """Progress over rounds and clients, with the current training loss."""

    def __init__(self, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                                 disable=not enabled, transient=False)
        self.rounds = self.clients = None

    def __call__(self, kind: str, data: Any) -> None:
        p = self.progress
        if kind == "status":
            console.print(f"[dim]{data}[/]")
        elif kind == "start":
            p.start()
            self.rounds = p.add_task("rounds", total=data["rounds"], completed=data["first"] - 1, info="")
            self.clients = p.add_task("clients", total=1, completed=0, info="")
        elif kind == "progress" and self.clients is not None:
            loss = f"loss {data['loss']:.4f}" if data.get("loss") is not None else ""
            p.update(self.clients, total=max(data["total"], 1), completed=data["done"],
                     description=f"round {data['round']} {data['phase']}", info=loss)
        elif kind == "round" and self.rounds is not None:
            m = data["metrics"]
            info = f"train_loss {m.get('train_loss', float('nan')):.4f}"
            if "accuracy" in m:
                info += f"  acc {m['accuracy']:.3f}"
            p.update(self.rounds, advance=1, info=info)
            p.update(self.clients, completed=p.tasks[self.clients].total, description=f"round {data['round']} done",
                     info="")
            if data["failures"]:
                p.console.print(f"[yellow]round {data['round']}: clients left out: {data['failures']}[/]")

    def stop(self) -> None:
        self.progress.stop()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary_table(outcome) -> Table:
    last = outcome.last_eval
    table = Table(title=f"final evaluation (round {last['round']})" if last else "summary")
    for col in ("client", "tasks", "train n", "accuracy", "test loss", "sent up", "sent down"):
        table.add_column(col, justify="right" if col != "tasks" else "left")
    per = last["client_metrics"] if last else {}
    totals = {}
    for r in outcome.rounds:
        for cid, m in r["client_metrics"].items():
            t = totals.setdefault(int(cid), [0.0, 0.0])
            t[0] += m.get("bytes_up", 0.0)
            t[1] += m.get("bytes_down", 0.0)
    for c in outcome.clients:
        m = per.get(c.cid, {})
        up, down = totals.get(c.cid, [0.0, 0.0])
        table.add_row(str(c.cid), ",".join(c.tasks), str(len(c.train)),
                      f"{m['accuracy']:.3f}" if "accuracy" in m else "—",
                      f"{m['test_loss']:.4f}" if "test_loss" in m else "—", human_bytes(up), human_bytes(down))
    if last:
        g = last["metrics"]
        table.add_row("all", "weighted", "", f"{g.get('accuracy', float('nan')):.3f}",
                      f"{g.get('test_loss', float('nan')):.4f}", "", "", style="bold")
    return table


def cmd_run(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator.config import load_config
    from fedsweep.orchestrator.runner import run

    cfg = load_config(args.config, args.overrides)
    view = RunView(enabled=not args.quiet)
    try:
        outcome = run(cfg, resume=args.resume, on_event=view)
    finally:
        view.stop()
    console.print(summary_table(outcome))
    rounds = outcome.rounds
    if rounds:
        secs = [r["metrics"]["round_seconds"] for r in rounds]
        console.print(f"rounds {rounds[0]['round']}–{rounds[-1]['round']}: {sum(secs):.1f}s "
                      f"({sum(secs) / len(secs):.1f}s per round); checkpoints in {outcome.run_dir / 'checkpoints'}")
    if outcome.run_id:
        console.print(f"MLflow run [bold]{outcome.run_id}[/] in experiment '{cfg.tracking.experiment or cfg.name}' "
                      f"at {outcome.tracking_uri}")
        console.print(f"  open it with: mlflow ui --backend-store-uri {outcome.tracking_uri}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    from fedsweep.data.records import DataError
    from fedsweep.models.lora import AdapterError
    from fedsweep.models.loading import ModelError
    from fedsweep.orchestrator.config import ConfigError
    from fedsweep.orchestrator.runner import RunError

    handlers = {"run": cmd_run, "validate": cmd_validate, "algorithms": cmd_algorithms}
    try:
        return handlers[args.command](args)
    except (ConfigError, DataError, ModelError, AdapterError, RunError) as exc:
        err.print(f"[red]error[/]: {exc}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]: the last complete round is checkpointed; continue with --resume")
        return 130


if __name__ == "__main__":
    sys.exit(main())
