"""Open an MLflow store's experiment the way fedsweep tells a user to, in headless Chromium.

    python tools/mlflow_screenshot.py sqlite:///results/mlflow.db main docs/images/mlflow-runs.png [--charts]

Starts ``mlflow ui`` on 127.0.0.1 (a free port) over the store, opens the link fedsweep prints
(``fedsweep.orchestrator.tracking.ui.experiment_path``), waits for every run of the experiment to be
listed by name, and saves a screenshot. Needs the ``playwright`` package and Debian's
``chromium`` (Playwright's own browser download needs the internet). The browser test in
``tests/test_study.py`` drives the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_ui(uri: str, timeout: float = 60.0):
    """``mlflow ui`` over ``uri`` on a free loopback port; yields its base URL, stops it after."""
    port = free_port()
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    server = subprocess.Popen([exe, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow ui did not start on port {port}") from None
                time.sleep(0.25)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextlib.contextmanager
def browser_page(width: int = 1600, height: int = 900):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def close_assistant(page) -> None:
    """Fold MLflow's assistant side panel away, if it is open (it takes a fifth of the page)."""
    with contextlib.suppress(Exception):
        page.locator("[data-component-id='mlflow.assistant.chat_panel.close']").click(timeout=3_000)
        page.wait_for_timeout(500)


def wait_for_runs(page, names: list[str], timeout_ms: int = 60_000) -> None:
    for name in names:
        page.get_by_role("link", name=name, exact=True).wait_for(timeout=timeout_ms)


def wait_for_charts(page, section: str, timeout_ms: int = 60_000) -> None:
    page.get_by_text(section).first.wait_for(timeout=timeout_ms)
    page.locator(".js-plotly-plot").first.wait_for(timeout=timeout_ms)
    page.wait_for_timeout(1_500)  # the charts' lines draw after their frames


def main() -> int:
    from mlflow.tracking import MlflowClient

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fedsweep.orchestrator.tracking.ui import experiment_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("uri")
    ap.add_argument("experiment")
    ap.add_argument("out")
    ap.add_argument("--charts", action="store_true", help="the charts view instead of the runs table")
    args = ap.parse_args()
    client = MlflowClient(tracking_uri=args.uri)
    exp = client.get_experiment_by_name(args.experiment)
    names = [r.info.run_name for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("mlflow.parentRunId")]
    with mlflow_ui(args.uri) as base, browser_page() as page:
        page.goto(f"{base}/#{experiment_path(exp.experiment_id, charts=args.charts)}")
        wait_for_runs(page, names)
        close_assistant(page)
        if args.charts:
            wait_for_charts(page, "fedsweep:")
        page.screenshot(path=args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
