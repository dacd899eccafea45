"""``tools/gpu_check.py``'s plan of steps (what ``make gpu-check`` and ``make gpu-profile`` run), without a GPU."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_check_leaves_the_profile_out_and_keeps_every_figure_and_test(tmp_path):
    """Issue #57's check: the ratios (bf16, fp32, Llama), the planner, the demo's round, the CUDA equality
    tests and ``pytest -m gpu`` by default; the profile (K = 50) only with ``--profile``, last."""
    gpu_check = _gpu_check()
    default = gpu_check.steps(False, tmp_path)
    names = [name for name, *_ in default]
    assert names == ["smollm2-bf16", "llama8b-k16", "llama8b-plan", "smollm2-fp32", "demo-round-k50",
                     "lockstep-equality-cuda", "gpu-tests"]
    assert all("--ops" not in argv for _, argv, _, _ in default)
    profiled = gpu_check.steps(False, tmp_path, profile=True)
    assert [name for name, *_ in profiled] == names + ["smollm2-bf16-profile"]
    assert "--ops" in profiled[-1][1] and profiled[-1][1][profiled[-1][1].index("--clients") + 1] == "50"
    equality = dict((name, env) for name, _, env, _ in default)["lockstep-equality-cuda"]
    assert equality == {"FEDSWEEP_TEST_DEVICE": "cuda"}
    assert any("-m" in argv and "gpu" in argv for name, argv, _, _ in default if name == "gpu-tests")
