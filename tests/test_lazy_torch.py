"""The driver of a run never imports torch (``fedsweep.lazy``), and the stand-in is torch itself
once used: the same objects, pickled as the module, gradients off under ``no_grad``."""

import json
import pickle
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent("""
    import json, sys, tempfile
    from fedsweep.orchestrator import preflight
    from fedsweep.cli import build_parser
    import fedsweep.actors.remote, fedsweep.bench.run, fedsweep.orchestrator.runner
    import fedsweep.orchestrator.tracking.tracker, fedsweep.orchestrator.study
    from fedsweep.algorithms import registry
    from fedsweep.orchestrator.experiment_data import prepare_data
    from fedsweep.orchestrator.runtime.placement import cluster_view
    from fedsweep.plan.resolve import resolve_layout
    out, stores = {}, tempfile.mkdtemp()
    for i, (path, sets) in enumerate([("configs/bench/flower_tiny.yaml", ["clients.num_clients=50"]),
                                      ("configs/bench/flower_smollm135m.yaml", ["clients.num_clients=50"]),
                                      ("configs/experiments/smoke.yaml", [])]):
        uri = f"sqlite:///{stores}/{i}.db"
        cfg = preflight.load_experiment(path, sets + [f"tracking.uri={uri}"])
        out[f"store {i}"] = preflight.store_prepared(uri)  # MLflow and the store's schema, prepared
        prepare_data(cfg)
        registry.capabilities(cfg.algorithm)
        cfg, layout = resolve_layout(cfg, cluster_view(cfg, {"CPU": 3.0, "memory": 16 * 2 ** 30}))
        out[path] = cfg.num_actors
    for name in registry.names():  # every method's hyperparameters and capabilities
        registry.get(name).Params.model_json_schema()
    out["torch"] = "torch" in sys.modules
    out["heavy"] = sorted(m for m in ("transformers", "peft", "safetensors.torch") if m in sys.modules)
    print(json.dumps(out))
""")


def test_a_run_s_driver_path_does_not_import_torch():
    """Config validation (every method's hyperparameter classes), data, the layout, and every module
    the driver imports for a run, a benchmark or a study (MLflow is the driver's): no torch, no
    transformers (a module-level
    ``torch.x``, a ``@torch.no_grad()`` or ``import torch.nn`` in one of them fails this)."""
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["torch"] is False and out["heavy"] == []
    assert [out[f"store {i}"] for i in range(3)] == [True] * 3
    assert out["configs/bench/flower_tiny.yaml"] >= 1  # the layout was computed, not skipped


def test_the_stand_in_is_torch_once_used(monkeypatch):
    import torch

    from fedsweep.lazy import STAND_IN as lazy, loaded

    import fedsweep.actors.server
    import fedsweep.algorithms.tensors

    assert loaded()
    assert lazy.float32 is torch.float32
    # once used, the modules that named the stand-in hold torch itself (no cost per lookup after that)
    assert fedsweep.algorithms.tensors.torch is torch and fedsweep.actors.server.torch is torch
    import fedsweep.lazy

    assert fedsweep.lazy.torch is torch and lazy is fedsweep.lazy.STAND_IN and lazy.Tensor is torch.Tensor and lazy.nn.functional is torch.nn.functional
    x = lazy.arange(6, dtype=lazy.float32).reshape(2, 3)
    assert isinstance(x, torch.Tensor) and torch.equal(x, torch.arange(6.0).reshape(2, 3))
    # a patched torch attribute is seen through the stand-in (it copies nothing)
    monkeypatch.setattr(torch, "cat", lambda *a, **k: "patched")
    assert lazy.cat([x]) == "patched"
    with pytest.raises(AttributeError):
        lazy.no_such_attribute_in_torch
    # pickled as the module: unpickled, it is torch itself (Ray and cloudpickle ship closures this way)
    assert pickle.loads(pickle.dumps(lazy)) is torch
    import cloudpickle

    def uses(t):
        return lazy.ones(2) * t

    again = pickle.loads(cloudpickle.dumps(uses))
    assert torch.equal(again(3.0), torch.full((2,), 3.0))


def test_no_grad_turns_gradients_off_and_keeps_the_function():
    import torch

    from fedsweep.lazy import no_grad

    w = torch.ones(3, requires_grad=True)

    @no_grad
    def forward(scale: float) -> torch.Tensor:
        """doc"""
        return w * scale

    assert forward.__name__ == "forward" and forward.__doc__ == "doc"
    assert not forward(2.0).requires_grad and (w * 2.0).requires_grad
    assert torch.is_grad_enabled()  # restored after the call


SERVER = textwrap.dedent("""
    import json, sys, tempfile
    from fedsweep.config import load_config
    from fedsweep.actors import server
    from fedsweep.lazy import STAND_IN

    seen = {}

    class Asked(Exception):
        pass

    class ClientActorHandle:  # the first thing the server asks a client actor: which incarnation answers
        class incarnation:
            @staticmethod
            def remote():
                seen["torch when the server first asks"] = "torch" in sys.modules
                seen["server module rebound"] = server.torch is not STAND_IN
                raise Asked

    from fedsweep.config.schema import BatchPlan

    cfg = load_config("configs/experiments/smoke.yaml", []).with_batch_plan(BatchPlan(2))
    seen["torch before"] = "torch" in sys.modules
    try:
        server.ServerActor(cfg, [], [ClientActorHandle()], {}, tempfile.mkdtemp())
    except Asked:
        pass
    print(json.dumps(seen))
""")


def test_the_server_actor_imports_torch_before_it_waits_for_the_client_actors():
    """θ_0 arrives as tensors: the server imports torch while the client actors build, rather than
    after θ_0 arrives, when the clients wait on it (1 s on a core otherwise idle, 2-core VM)."""
    import os

    done = subprocess.run([sys.executable, "-c", SERVER], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"torch before": False, "torch when the server first asks": True, "server module rebound": True}
