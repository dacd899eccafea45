"""What the ``fedsweep`` commands print: consoles, the run progress view, tables, byte sizes."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from fedsweep.orchestrator.terminal import console, err  # noqa: F401  (the commands take them from here)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The experiment file argument and repeatable ``--set`` overrides."""
    p.add_argument("config", help="experiment YAML (e.g. configs/experiments/smoke.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set clients.num_clients=8 (repeatable)")


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
        elif kind == "layout":
            console.print(f"[dim]layout: {data.describe()}[/]", highlight=False)
        elif kind == "warning":
            console.print(f"[yellow]warning[/]: {data}", highlight=False, soft_wrap=True)
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
            for cid, why in sorted(data.get("retried", {}).items()):
                p.console.print(f"[yellow]round {data['round']}: client {cid} recovered: {why}[/]", highlight=False)
            for cid, why in sorted(data["failures"].items()):
                p.console.print(f"[yellow]round {data['round']}: client {cid} left out: {why}[/]", highlight=False)

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


def print_report(experiment: str, uri: str, metric: str, out: str = "results/reports", all_runs: bool = False,
           baseline: str = "fedavg", alpha: float = 0.05, also: tuple[str, ...] = ()) -> None:
    """Write the comparison report and print its table and what is significant."""
    from fedsweep.reports.compare import compare
    from fedsweep.errors import ConfigError

    try:
        path, table, found = compare(experiment, uri, out, metric, all_runs, baseline, alpha, also)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    console.print(table, highlight=False, soft_wrap=True)
    if found:
        console.print("\n".join(found), highlight=False, soft_wrap=True)
    console.print(f"report: {path} (and plots beside it)")
