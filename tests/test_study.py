"""Ray Tune studies and MLflow comparisons on the smoke setup (real Tune, real MLflow)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from mlflow.tracking import MlflowClient

from fedsweep.reports.compare import compare
from fedsweep.config import ConfigError
from fedsweep.config.sweep import load_sweep, trial_count
from fedsweep.orchestrator.study import tune_study

ROOT = Path(__file__).resolve().parents[1]
# under `pytest -n` (make test) this module stays on one worker: its module fixture is built once
pytestmark = pytest.mark.xdist_group("study")


def _sweep_file(tmp_path, tracking_uri, **extra) -> Path:
    raw = {"name": "study_" + tmp_path.name[-12:].replace("_", ""), "experiment": str(ROOT / "configs/experiments/smoke.yaml"),
           "set": ["clients.clients_per_actor=4", f"checkpoint.dir={tmp_path / 'runs'}"],
           "variants": {"fedavg": {"algorithm": "fedavg"}, "fedicu": {"algorithm": "fedicu"}},
           "seeds": [0, 1], "metric": "test_loss", "mode": "min", "tracking_uri": tracking_uri,
           "storage": str(tmp_path / "tune"), **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _children(client, name):
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("fedsweep.kind") == "study"]
    return parents, [r for r in runs if r.data.tags.get("fedsweep.kind") != "study"]


def test_sweep_file_errors_name_the_variant_and_path(tmp_path, tracking_uri):
    path = _sweep_file(tmp_path, tracking_uri, space={"fedicu.tau": {"grid": [0.1, -1.0]}})
    with pytest.raises(ConfigError, match=r"fedicu.tau=-1.0.*fedicu.tau = -1.0"):
        load_sweep(path)
    path = _sweep_file(tmp_path, tracking_uri, space={"fedicu.tau": {"grid": [0.1], "uniform": [0, 1]}})
    with pytest.raises(ConfigError, match="exactly one of grid"):
        load_sweep(path)
    path = _sweep_file(tmp_path, tracking_uri, question={"text": "?", "rows": ["fedicu", "fedprox"]})
    with pytest.raises(ConfigError, match="question.rows: fedprox is not a variant"):
        load_sweep(path)


@pytest.fixture(scope="module")
def study(ray_session, tmp_path_factory, tracking_uri):
    """A four-trial study run as ``fedsweep tune`` runs it (progress view on, Tune's reporter quiet),
    its console captured; then its comparison report."""
    import io

    from rich.console import Console

    from fedsweep.orchestrator import study_view

    tmp_path = tmp_path_factory.mktemp("study")
    question = {"text": "Does FedICU beat FedAvg?", "rows": ["fedicu fedicu.tau=0.1", "scaffold"]}
    sweep, base = load_sweep(_sweep_file(tmp_path, tracking_uri, space={"fedicu.tau": {"grid": [0.1]}},
                                         question=question))
    out = Console(file=io.StringIO(), width=160, force_terminal=False)
    original, study_view.console = study_view.console, out
    try:
        results, parent_id = tune_study(sweep, base, progress=True)
    finally:
        study_view.console = original
    report = compare(sweep.name, tracking_uri, str(tmp_path / "reports"), "test_loss")
    return SimpleNamespace(sweep=sweep, results=results, parent_id=parent_id, console=out.file.getvalue(),
                           report=report, tmp_path=tmp_path, uri=tracking_uri)


def test_four_trial_study_tracks_parent_and_children_and_reports(study):
    sweep, results, parent_id, tracking_uri = study.sweep, study.results, study.parent_id, study.uri
    assert trial_count(sweep) == 4
    assert len(results) == 4 and not results.errors
    client = MlflowClient(tracking_uri)
    parents, children = _children(client, sweep.name)
    assert [p.info.run_id for p in parents] == [parent_id] and parents[0].info.status == "FINISHED"
    assert len(children) == 4
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent_id and child.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "test_loss")] == [1, 2]
    assert sorted(c.data.params["seed"] for c in children) == ["0", "0", "1", "1"]
    report, table, _ = study.report
    assert "| fedavg fedicu.tau=0.1 | 2 |" in table and "| fedicu fedicu.tau=0.1 | 2 |" in table
    # two seeds a method: the run is the unit, so no test decides and no cell is marked significant
    assert table.count("**") == 0
    text = report.read_text()
    assert "undecided (fewer than 3 runs a row)" in text
    assert "test_loss_per_round.png" in text and (report.parent / "test_loss_per_client.png").exists()
    assert (report.parent / "test_loss_vs_fedicu_tau.png").exists()
    logged = {a.path for a in client.list_artifacts(parent_id, "report")}
    assert "report/report.md" in logged and "report/test_loss_per_round.png" in logged
    # the sweep's question, answered from the same paired test the table marks
    asked = text.split("## The question", 1)[1].split("## What is significant", 1)[0]
    assert "**Does FedICU beat FedAvg?**" in asked and "- **scaffold**: not tested" in asked
    line = next(x for x in asked.splitlines() if x.startswith("- **fedicu fedicu.tau=0.1"))
    # two runs a row: no run-level test, said so, and the client pairs only as description
    assert ": undecided** — fewer than 3 runs a row" in line and "description only" in line
    assert "client × seed pairs" in line and "could have detected" not in line
    assert study.report[2][0].startswith("**Does FedICU beat FedAvg?**")  # printed first on the console


def test_report_columns_asked_for_show_each_runs_last_round_value(study):
    """``also`` (a sweep's ``report_metrics``, ``compare --also``): a run-level metric as a column
    beside the compared one, the mean over seeds of each run's last-round value (not the mean over
    rounds), and a metric no run logged is refused by name."""
    import numpy as np

    client = MlflowClient(study.uri)
    _, children = _children(client, study.sweep.name)
    key = "aggregation_seconds"  # logged every round by every method, different each round
    last: dict[str, list[float]] = {}
    for child in children:
        history = sorted(client.get_metric_history(child.info.run_id, key), key=lambda m: m.step)
        assert len(history) == 2
        last.setdefault(child.data.tags["fedsweep.label"], []).append(history[-1].value)
    note = client.get_run(study.parent_id).data.tags["mlflow.note.content"]
    try:
        _, table, _ = compare(study.sweep.name, study.uri, str(study.tmp_path / "also"), "test_loss", also=(key,))
    finally:  # the study's note is the fixture's report: other tests read it
        client.set_tag(study.parent_id, "mlflow.note.content", note)
    head, _, *rows = table.splitlines()
    cells = [c.strip() for c in head.split("|")]
    assert cells[5:7] == ["test loss", "aggregation seconds"]
    for row in rows:
        parts = [c.strip() for c in row.split("|")]
        shown = float(parts[6].split()[0])
        assert shown == pytest.approx(float(np.mean(last[parts[1].removesuffix(' (baseline)')])), rel=1e-3)
    assert (study.tmp_path / "also" / study.sweep.name / f"{key}_vs_fedicu_tau.png").exists()  # against the swept value
    with pytest.raises(ValueError, match="no run of .* logged no_such_metric"):
        compare(study.sweep.name, study.uri, str(study.tmp_path / "also"), "test_loss", also=("no_such_metric",))


def test_study_runs_are_named_tagged_and_described_for_the_mlflow_ui(study):
    client = MlflowClient(study.uri)
    exp = client.get_experiment_by_name(study.sweep.name)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    parents, children = _children(client, study.sweep.name)
    names = sorted(c.info.run_name for c in children)
    assert names == ["fedavg fedicu.tau=0.1 seed 0", "fedavg fedicu.tau=0.1 seed 1",
                     "fedicu fedicu.tau=0.1 seed 0", "fedicu fedicu.tau=0.1 seed 1"]
    for child in children:
        tags, params = child.data.tags, child.data.params
        assert tags["method"] == params["algorithm"] and tags["variant"] == child.info.run_name.split()[0]
        assert tags["seed"] == params["seed"] and tags["num_clients"] == params["clients.num_clients"] == "4"
        assert tags["fedsweep.kind"] == "trial" and tags["fedsweep.study"] == study.sweep.name
        rounds = [m.value for m in client.get_metric_history(child.info.run_id, "round")]
        assert rounds == [1.0, 2.0]
    note = parents[0].data.tags["mlflow.note.content"]
    _, table, found = study.report
    assert table in note and all(line in note for line in found)
    assert "report/test_loss_per_round.png" in note and "![" not in note  # plots named, not broken inline images
    # the saved view: sorted by the study's metric (a flat table), its chart first
    envelope = json.loads(exp.tags["mlflow.sharedViewState.fedsweep"])
    assert isinstance(envelope["name"], str) and isinstance(envelope["createdAt"], int)
    state = json.loads(envelope["state"])
    assert state["orderByKey"] == "metrics.`test_loss`" and state["orderByAsc"] is True
    assert "metrics.`test_loss`" in state["selectedColumns"] and "tags.`variant`" in state["selectedColumns"]
    assert state["compareRunCharts"][0]["metricKey"] == "test_loss"
    assert state["compareRunCharts"][0]["metricSectionId"] == state["compareRunSections"][0]["uuid"]


def test_study_console_is_a_progress_view_without_tracebacks(study):
    text = study.console
    lines = text.splitlines()
    assert "Traceback" not in text and "Trial status" not in text and "╭" not in text
    done = [l for l in lines if l.startswith("✓ ")]
    assert sorted(l.split(":")[0] for l in done) == ["✓ fedavg fedicu.tau=0.1 seed 0", "✓ fedavg fedicu.tau=0.1 seed 1",
                                                      "✓ fedicu fedicu.tau=0.1 seed 0", "✓ fedicu fedicu.tau=0.1 seed 1"]
    client = MlflowClient(study.uri)
    _, children = _children(client, study.sweep.name)
    final = {c.info.run_name: client.get_metric_history(c.info.run_id, "test_loss")[-1].value for c in children}
    for line in done:
        name, shown = line[2:].split(": test_loss ")
        assert float(shown.split()[0]) == pytest.approx(final[name], rel=1e-3)
    assert "trials" in lines[-1] and "4/4" in lines[-1] and "0 running · 0 pending" in lines[-1]
    best = min(final, key=final.get)
    assert f"best {best}: test_loss" in lines[-1]
    log = (study.tmp_path / "tune" / study.sweep.name / "study.log").read_text()
    assert log.count(" round 2: ") == 4 and log.count(" finished") == 4


def test_runs_command_lists_the_study_and_its_trials(study, capsys):
    from fedsweep.cli import main
    from fedsweep.reports.run_index import collect

    studies, runs = collect(study.uri, study.sweep.name)
    client = MlflowClient(study.uri)
    _, children = _children(client, study.sweep.name)
    assert [s.name for s in studies] == [study.sweep.name] and studies[0].status == "FINISHED"
    assert (studies[0].trials_finished, studies[0].trials) == (4, 4)
    final = {c.info.run_name: c.data.metrics["test_loss"] for c in children}
    best = min(final, key=final.get)
    assert studies[0].best.startswith(f"{best}: test_loss ")
    assert sorted(r.name for r in runs) == sorted(final)
    for r in runs:
        assert r.rounds_done == r.rounds == 2 and r.status == "FINISHED" and r.study == study.sweep.name
        assert r.final == f"test_loss {final[r.name]:.4g}" and r.checkpoints.endswith("checkpoints")
        assert Path(r.checkpoints).is_dir() or (Path.cwd() / r.checkpoints).is_dir()
    assert main(["runs", "--uri", study.uri, "--experiment", study.sweep.name]) == 0
    out = capsys.readouterr().out
    assert study.sweep.name in out and "FINISHED" in out
    assert main(["runs", "--uri", study.uri, "--experiment", "no_such_study"]) == 2
    assert "no MLflow experiment named 'no_such_study'" in capsys.readouterr().err


def test_interrupted_study_resumes_without_rerunning_finished_trials(ray_session, tmp_path, tracking_uri, monkeypatch):
    import io

    from rich.console import Console

    from fedsweep.orchestrator import study_view

    sweep, base = load_sweep(_sweep_file(tmp_path, tracking_uri, max_concurrent_trials=1, seeds=[0, 1],
                                         variants={"fedavg": {"algorithm": "fedavg"}}))
    assert trial_count(sweep) == 2
    results, parent_id = tune_study(sweep, base, stop_after_trials=1, progress=True)
    client = MlflowClient(tracking_uri)
    _, children = _children(client, sweep.name)
    done_before = {c.info.run_id for c in children if c.info.status == "FINISHED"}
    assert len(done_before) == 1
    out = Console(file=io.StringIO(), width=160, force_terminal=False)
    monkeypatch.setattr(study_view, "console", out)
    results, parent_again = tune_study(sweep, base, resume=True, progress=True)  # the pickled callback comes back
    assert parent_again == parent_id
    _, children = _children(client, sweep.name)
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert len(finished) == 2 and done_before <= {c.info.run_id for c in finished}
    # a finished trial ran once: its round-1 metric was logged once
    for run_id in done_before:
        assert len(client.get_metric_history(run_id, "test_loss")) == 2
    assert client.get_run(parent_id).info.status == "FINISHED"
    # the resumed study's view: one trial ran here, the one before it counts as done
    (new,) = [c.info.run_name for c in finished if c.info.run_id not in done_before]
    lines = out.file.getvalue().splitlines()
    assert [l.split(":")[0] for l in lines if l.startswith("✓")] == [f"✓ {new}"]
    assert "2/2" in lines[-1] and "0 pending" in lines[-1]


@pytest.mark.slow
@pytest.mark.system
def test_mlflow_ui_in_a_real_browser_opens_on_the_named_runs_and_their_chart(study):
    """``mlflow ui`` over the study's store, the page fedsweep prints opened in headless Chromium:
    the runs table (not the GenAI overview) with every child by name, best first, and the metric's
    column; then the charts view with the study's chart first. Screenshots go to results/screenshots/."""
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    sys.path.insert(0, str(ROOT / "tools"))
    import mlflow_screenshot as ui

    if not Path(ui.CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
    from fedsweep.orchestrator.tracking.ui import experiment_path

    client = MlflowClient(study.uri)
    exp = client.get_experiment_by_name(study.sweep.name)
    _, children = _children(client, study.sweep.name)
    final = {c.info.run_name: c.data.metrics["test_loss"] for c in children}
    names = sorted(final)
    shots = ROOT / "results" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    with ui.mlflow_ui(study.uri) as base, ui.browser_page() as page:
        page.goto(f"{base}/#{experiment_path(exp.experiment_id)}")
        ui.wait_for_runs(page, names)  # every child on its own row, not folded under the study
        page.get_by_text("test_loss", exact=True).first.wait_for(timeout=30_000)  # the metric's column
        assert f"/experiments/{exp.experiment_id}/runs" in page.url
        assert "No data available" not in page.inner_text("body")  # not the GenAI overview
        rows = [page.get_by_role("link", name=n, exact=True).bounding_box()["y"] for n in names]
        assert [n for _, n in sorted(zip(rows, names))] == sorted(final, key=final.get)  # best first
        ui.close_assistant(page)
        page.screenshot(path=str(shots / "mlflow_runs.png"))
        page.goto(f"{base}/#{experiment_path(exp.experiment_id, charts=True)}")
        ui.wait_for_charts(page, "fedsweep: test_loss per round")
        page.screenshot(path=str(shots / "mlflow_charts.png"))


@pytest.mark.long  # a six-trial study, 113-128 s alone: make test-system
def test_a_reproduction_card_runs_its_study_and_judges_each_hypothesis(ray_session, tmp_path, tracking_uri):
    """A two-row card on the tiny model (local vs FedAvg on disjoint tasks, three seeds): its study runs
    as a study does, every hypothesis gets its statistics and a verdict with the run as the unit, the
    report names them, its CSV verifies, and the study's parent run carries the verdicts as tags; a
    hypothesis pairing rows on other data is refused in one line."""
    from fedsweep.config.card import load_card
    from fedsweep.reports.verdicts import VERDICTS
    from fedsweep.reproduce.card_run import conclude, study_file
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    study = {"experiment": str(ROOT / "configs/experiments/smoke.yaml"),
             "set": ["clients.clients_per_actor=4", f"checkpoint.dir={tmp_path / 'runs'}", "rounds=1",
                     "eval.max_new_tokens=0"],
             "variants": {"fedavg": {"algorithm": "fedavg"}, "local": {"algorithm": "local"}},
             "seeds": [0, 1, 2], "tracking_uri": tracking_uri, "storage": str(tmp_path / "tune")}
    card_raw = {"card": "tiny", "version": 1, "paper": "a paper", "registered": "2026-11-26",
                "hypotheses": [{"id": "local_lower", "paper": "Table 0", "claim": "local reaches a lower test loss",
                                "metric": "test_loss", "kind": "less", "treatment": "local", "baseline": "fedavg",
                                "role": "claim", "effect": 0.1, "effect_basis": "a stated reason: 10 % perplexity"},
                               {"id": "bounded", "paper": "Table 0", "claim": "local's test loss stays below 100",
                                "metric": "test_loss", "kind": "at_most", "treatment": "local", "bound": 100,
                                "role": "property", "effect": 1.0, "effect_basis": "a stated reason"}],
                "budgets": {"cpu": {"minutes": 1, "differs": "everything", "study": study}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(card_raw))
    card, _ = load_card(str(path))
    sweep, base = load_sweep(study_file(card, "cpu", path, tmp_path))
    _, parent = tune_study(sweep, base, progress=True)
    outcomes, report = conclude(card, "cpu", sweep, parent, None, str(tmp_path / "reports"))
    by_id = {o.id: o for o in outcomes}
    assert by_id["local_lower"].n == 3 and by_id["local_lower"].verdict in VERDICTS
    assert by_id["local_lower"].unit == "run (seed)"
    # three runs of different seeds spread: a p-value, whatever the verdict
    assert by_id["local_lower"].undecided is None and math.isfinite(by_id["local_lower"].p_holm)
    assert by_id["bounded"].verdict == "reproduced" and by_id["bounded"].n == 3  # (a loss near 3 on three runs)
    from fedsweep.reproduce.card_report import verify

    assert report.with_suffix(".csv").is_file() and verify(report) == []  # the values behind every verdict
    text = report.read_text()
    assert "local_lower" in text and "**" + by_id["local_lower"].verdict + "**" in text and "Table 0" in text
    tags = MlflowClient(tracking_uri=tracking_uri).get_run(parent).data.tags
    assert tags["fedsweep.verdict.local_lower"] == by_id["local_lower"].verdict
    assert report.with_suffix(".png").is_file()  # the figure, beside the report and on the parent run
    logged = [a.path for a in MlflowClient(tracking_uri=tracking_uri).list_artifacts(parent)]
    assert report.with_suffix(".png").name in logged
