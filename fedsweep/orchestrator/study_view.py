"""What ``fedsweep tune`` shows while a study runs: one progress view, not Tune's periodic table.

:class:`StudyView`, fed by a Tune callback in the driver (:class:`StudyCallback`), keeps one
live line — trials done, running and pending, the best trial so far with its metric, elapsed and
estimated remaining time — and prints one line per trial that ends (its metric, or why it
failed). Everything Tune would have printed, and more (each trial's parameters, every round's
metrics, the full error text of a failed trial), goes to the study's log file instead.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

from ray.tune import Callback

from fedsweep.orchestrator.terminal import console


def remaining_seconds(elapsed: float, done: int, total: int) -> float | None:
    """Remaining time if the trials left go as fast as those done: the study's throughput so far
    (trials ended per second, concurrency included) applied to the ones left. None before any
    trial has ended here."""
    if done == 0 or done >= total:
        return None if done == 0 else 0.0
    return elapsed / done * (total - done)


def clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


CURRENT: list["StudyView"] = []
"""The view of the study this process is running. Tune pickles its callbacks with the study and
unpickles them on ``--resume``: the callback holds no view of its own and feeds the current one."""


class StudyCallback(Callback):
    """Feeds the current view (none: does nothing)."""

    @staticmethod
    def _view() -> "StudyView | None":
        return CURRENT[-1] if CURRENT else None

    def on_trial_start(self, iteration, trials, trial, **info):
        if view := self._view():
            view.started(trial.trial_id, trial.config)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if view := self._view():
            view.result(trial.trial_id, trial.config, result)

    def on_trial_complete(self, iteration, trials, trial, **info):
        if view := self._view():
            view.ended(trial.trial_id, trial.config, None)

    def on_trial_error(self, iteration, trials, trial, **info):
        if view := self._view():
            view.ended(trial.trial_id, trial.config, error_text(trial))

    def on_step_end(self, iteration, trials, **info):
        if view := self._view():
            view.sync({t.trial_id: t.status for t in trials})


def error_text(trial) -> str:
    """A failed trial's error: Tune's error file if there is one, else its error message."""
    path = getattr(trial, "error_file", None)
    if path and Path(path).exists():
        return Path(path).read_text(errors="replace")
    return str(getattr(trial, "error_msg", "") or "unknown error")


def last_error_line(text: str) -> str:
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errors = [l for l in lines if l.split(":")[0].split(".")[-1].endswith(("Error", "Exception"))]
    return (errors[-1] if errors else lines[-1] if lines else "unknown error")[:300]


class StudyView:
    """Progress of one study. ``total`` trials, ``metric`` to rank by (``mode`` min or max),
    ``rounds`` per trial, ``name_of`` a trial's name from its Tune config (its MLflow run name),
    ``log`` the study's log file."""

    def __init__(self, total: int, metric: str, mode: str, rounds: int, name_of: Callable[[dict[str, Any]], str],
                 log: Path, enabled: bool = True, out=None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.total, self.metric, self.mode, self.rounds, self.name_of = total, metric, mode, rounds, name_of
        self.out = out or console
        self.start = time.monotonic()
        self.best: tuple[float, str] | None = None
        self.resumed = -1
        self.last: dict[str, tuple[Any, Any]] = {}
        self.statuses: dict[str, str] = {}
        """Tune's status of every trial it knows (a resumed study's finished ones included)."""
        self.tracking_waiting, self.tracking_away = 0, False
        self.live = enabled and self.out.is_terminal  # elsewhere (a log, a pipe) the last line is printed at the end
        self.enabled = enabled
        self.progress = Progress(TextColumn("trials"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), console=self.out, disable=not self.live,
                                 transient=False)
        self.task = self.progress.add_task("study", total=total, info="")
        self.log = logging.getLogger("fedsweep.study")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.handler = logging.FileHandler(log, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        for name in ("fedsweep.study", "ray.tune", "ray.train"):
            logging.getLogger(name).addHandler(self.handler)
        self.log_path = log

    # ------------------------------------------------------------------ events
    def started(self, trial_id: str, config: dict[str, Any]) -> None:
        self.log.info("trial %s (%s) started: %s", trial_id, self.name_of(config), config)
        self.refresh()

    def result(self, trial_id: str, config: dict[str, Any], result: dict[str, Any]) -> None:
        name = self.name_of(config)
        shown = {k: v for k, v in result.items() if isinstance(v, (int, float)) and not k.startswith("time_")}
        self.log.info("trial %s (%s) round %s: %s", trial_id, name, result.get("round"), shown)
        value = result.get(self.metric)
        self.last[trial_id] = (value, result.get("round"))
        if isinstance(value, (int, float)) and math.isfinite(value) and result.get("round") == self.rounds:
            better = self.best is None or (value < self.best[0] if self.mode == "min" else value > self.best[0])
            if better:
                self.best = (float(value), name)
        self.refresh()

    def ended(self, trial_id: str, config: dict[str, Any], error: str | None) -> None:
        name = self.name_of(config)
        if error is None:
            self.log.info("trial %s (%s) finished", trial_id, name)
            value, rnd = self.last.get(trial_id, (None, None))
            shown = f": {self.metric} {value:.4g} after round {rnd}" if isinstance(value, (int, float)) else ""
            self.progress.console.print(f"[green]✓[/] {name}{shown}", highlight=False)
        else:
            self.log.error("trial %s (%s) failed:\n%s", trial_id, name, error)
            self.progress.console.print(f"[red]✗[/] {name} failed: {last_error_line(error)} "
                                        f"[dim](full error in {self.log_path})[/]", highlight=False, soft_wrap=True)
        self.refresh()

    def tracking(self, waiting: int, away: bool) -> None:
        """The trials' tracking records that wait on disk (``tracking.courier``) and whether the server answers."""
        if away and not self.tracking_away:
            self.log.warning("tracking server does not answer: %d record(s) wait on disk", waiting)
        self.tracking_waiting, self.tracking_away = waiting, away
        self.refresh()

    # ---------------------------------------------------------------- the line
    def sync(self, statuses: dict[str, str]) -> None:
        self.statuses = dict(statuses)
        if self.resumed < 0:  # the first count: trials a resumed study had ended before this run
            self.resumed = self.counts()[0]
        self.refresh()

    def counts(self) -> tuple[int, int, int, int]:
        """(ended, running, pending, failed), from Tune's statuses at its last step."""
        values = list(self.statuses.values())
        failed = values.count("ERROR")
        ended = values.count("TERMINATED") + failed
        running = values.count("RUNNING")
        return ended, running, max(self.total - ended - running, 0), failed

    def line(self) -> str:
        ended, running, pending, failed = self.counts()
        elapsed = time.monotonic() - self.start
        parts = [f"{running} running", f"{pending} pending"]
        if failed:
            parts.append(f"{failed} failed")
        if self.tracking_away:
            parts.append(f"tracking server away: {self.tracking_waiting} record(s) wait")
        if self.best is not None:
            parts.append(f"best {self.best[1]}: {self.metric} {self.best[0]:.4g}")
        before = max(self.resumed, 0)
        eta = remaining_seconds(elapsed, ended - before, self.total - before)
        parts.append(f"{clock(elapsed)} elapsed, ~{clock(eta)} left")
        return " · ".join(parts)

    def refresh(self) -> None:
        self.progress.update(self.task, completed=self.counts()[0], info=self.line())

    def __enter__(self) -> "StudyView":
        CURRENT.append(self)
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        CURRENT.remove(self)
        self.refresh()
        self.progress.stop()
        if self.enabled and not self.live:
            self.out.print(f"trials {self.counts()[0]}/{self.total} · {self.line()}", highlight=False, soft_wrap=True)
        for name in ("fedsweep.study", "ray.tune", "ray.train"):
            logging.getLogger(name).removeHandler(self.handler)
        self.handler.close()
