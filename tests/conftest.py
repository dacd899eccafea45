"""Shared fixtures: one Ray runtime and one MLflow store per test session (under ``make test``'s
``pytest -n 2`` each of the two workers is a session: two runtimes in all, never one per test)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "smoke.yaml"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from fedsweep.orchestrator.runtime import ray_runtime

    # the runtime ``fedsweep run`` starts (loopback only, lean, a watchdog), with 4 logical CPUs; the
    # actors' output stays in Ray's session logs (an actor's error still reaches the test, traceback and all)
    started = ray_runtime.ensure(4, log_to_driver=False)  # not inside an assert: python -O would skip it
    assert started, "a Ray runtime was already up in this test process"
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory) -> str:
    from fedsweep.orchestrator.tracking.tracker import prepare_store

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    prepare_store(uri)  # the schema is created once, here
    return uri


@pytest.fixture
def smoke_raw(tmp_path, tracking_uri) -> dict:
    """The smoke config as plain data, writing its checkpoints and tracking under tmp, with its 4 clients
    on one actor: an actor's start (torch, transformers, peft, the model) is most of a small run's
    CPU, so a test that is not about several actors starts one (set ``clients.clients_per_actor = 2``
    for two)."""
    raw = yaml.safe_load(SMOKE.read_text())
    raw["checkpoint"] = {"dir": str(tmp_path / "runs")}
    raw["tracking"] = {"uri": tracking_uri}
    raw["clients"]["clients_per_actor"] = 4
    return copy.deepcopy(raw)
