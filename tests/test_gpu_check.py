"""``tools/gpu_check.py``'s plan of steps (what ``make gpu-check`` and ``make gpu-profile`` run), without a GPU."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str):
    """``tools/NAME.py`` as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_check():
    return _tool("gpu_check")


def test_the_default_check_leaves_the_profile_out_and_keeps_every_figure_and_test(tmp_path):
    """Issue #57's check: the ratios (bf16, fp32, Llama), the planner, the demo's round, the CUDA equality
    tests and ``pytest -m gpu`` by default; the profile (K = 50) only with ``--profile``, last."""
    gpu_check = _gpu_check()
    default = gpu_check.steps(False, tmp_path)
    names = [name for name, *_ in default]
    assert names == ["smollm2-bf16", "smollm2-bf16-compiled", "llama8b-k16", "llama8b-plan", "smollm2-fp32",
                     "demo-round-k50", "lockstep-equality-cuda", "gpu-tests"]
    compiled = dict((name, argv) for name, argv, _, _ in default)["smollm2-bf16-compiled"]
    assert "train.compile=inductor" in compiled and compiled[compiled.index("--clients") + 1] == "50"
    assert all("--ops" not in argv for _, argv, _, _ in default)
    profiled = gpu_check.steps(False, tmp_path, profile=True)
    assert [name for name, *_ in profiled] == names + ["smollm2-bf16-profile"]
    assert "--ops" in profiled[-1][1] and profiled[-1][1][profiled[-1][1].index("--clients") + 1] == "50"
    equality = dict((name, env) for name, _, env, _ in default)["lockstep-equality-cuda"]
    assert equality == {"FEDSWEEP_TEST_DEVICE": "cuda"}
    assert any("-m" in argv and "gpu" in argv for name, argv, _, _ in default if name == "gpu-tests")


def test_the_ratio_table_reads_the_bench_rows_and_the_padding_free_column(tmp_path):
    """``ratios.txt``: grouped over bare from each row; the padding-free column only where measured."""
    import json

    gpu_check = _gpu_check()
    row = {"clients": 50, "batched_tokens_per_s": 58837.2, "bare_tokens_per_s": 91691.5, "grouped_over_bare": 0.6417,
           "sequential_tokens_per_s": None, "batched_mfu": 0.025}
    (tmp_path / "throughput_batched_smollm2-135m-bf16_cuda.json").write_text(
        json.dumps({"rows": [{**row, "bare_padding_free_over_bare": 1.4321}]}))
    (tmp_path / "throughput_batched_smollm2-135m-fp32_cuda.json").write_text(json.dumps({"rows": [row]}))
    lines = gpu_check.ratio_table(tmp_path).splitlines()
    assert "bare padding-free/bare" in lines[0]
    bf16, fp32 = lines[1].split(), lines[2].split()
    assert bf16[:6] == ["smollm2-135m-bf16", "50", "58,837", "91,692", "0.64×", "—"] and bf16[-1] == "1.43×"
    assert fp32[0] == "smollm2-135m-fp32" and fp32[-1] == "—"
    smollm = dict((name, argv) for name, argv, _, _ in gpu_check.steps(False, tmp_path))["smollm2-bf16"]
    assert "--padding-free" in smollm


def test_the_offline_bundle_strips_rays_wheel_and_stubs_the_data_version(tmp_path):
    """``make offline-bundle``: Ray's wheel loses its jars, dashboard build and source maps and keeps the
    rest; the stub distribution answers ``importlib.metadata`` with this machine's reasoning-gym version
    (the data cache's key); the data prepared is that of every gpu-check step on the demo."""
    import importlib.metadata as md
    import zipfile

    bundle = _tool("offline_bundle")
    wheel = tmp_path / "ray-0-py3-none-any.whl"
    kept = ["ray/__init__.py", "ray/_private/worker.py", "ray/dashboard/modules/x.py", "ray-0.dist-info/RECORD"]
    dropped = ["ray/jars/ray_dist.jar", "ray/dashboard/client/build/index.html", "ray/dashboard/static/app.js.map"]
    with zipfile.ZipFile(wheel, "w") as z:
        for name in kept + dropped:
            z.writestr(name, "x" * 1000)
    before, after = bundle.strip_wheel(wheel)
    assert after < before and sorted(zipfile.ZipFile(wheel).namelist()) == sorted(kept)
    info = bundle.stub_distribution(tmp_path / "site")
    (found,) = [d for d in md.distributions(path=[str(tmp_path / "site")])]
    assert found.metadata["Name"] == "reasoning-gym" and found.version == md.version("reasoning-gym")
    assert info.name == f"reasoning_gym-{md.version('reasoning-gym')}.dist-info"
    configs = bundle.gpu_check_configs()
    assert len(configs) == 7 and all(any(s.startswith("model.name=random:") for s in c) for c in configs)


def test_gpu_check_bundle_installs_the_wheels_and_points_the_steps_at_the_data(tmp_path):
    """``tools/gpu_check.py --bundle``: ``.whl/`` installed into the site folder without an index, and the
    steps' environment naming that folder, the stub distribution and the data cache of ``.devdata/``."""
    import subprocess
    import sys
    import zipfile

    gpu_check = _gpu_check()
    root = tmp_path / "repo"
    (root / ".whl").mkdir(parents=True)
    (root / ".devdata" / "site").mkdir(parents=True)
    wheel = root / ".whl" / "carried_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("carried_pkg.py", "VALUE = 42\n")
        z.writestr("carried_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: carried-pkg\nVersion: 1.0\n")
        z.writestr("carried_pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("carried_pkg-1.0.dist-info/RECORD", "")
    site = tmp_path / "site"
    env = gpu_check.bundle(root, site)
    assert env == {"PYTHONPATH": f"{site}{__import__('os').pathsep}{root / '.devdata' / 'site'}",
                   "FEDSWEEP_CACHE": str(root / ".devdata")}
    got = subprocess.run([sys.executable, "-c", "import carried_pkg; print(carried_pkg.VALUE)"],
                         env={"PYTHONPATH": env["PYTHONPATH"], "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert got.stdout.strip() == "42", got.stderr
    assert gpu_check.bundle(tmp_path / "empty", site) == {}  # nothing to carry: nothing changes


def test_the_check_fits_one_call_and_judges_every_target(tmp_path):
    """Every step's limit adds up to at most 540 s (one call of the device tool); the targets are read from
    the run's own JSON: MET, MISSED, or NOT MEASURED where a step wrote nothing."""
    import json

    gpu_check = _gpu_check()
    assert sum(limit for *_, limit in gpu_check.steps(False, tmp_path)) <= gpu_check.LIMIT_S == 540
    (tmp_path / "throughput_batched_smollm2-135m-bf16_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 160_000.0, "grouped_over_careful": 0.7}]}))
    (tmp_path / "run_demo-k50_k50.json").write_text(json.dumps({
        "run_over_ideal": 1.4, "phases_s": {"setup": 8.0}, "setup_s": 12.0,
        "per_round": [{"train": 5.0, "eval": 9.0}, {"train": 0.9, "eval": 0.8}, {"train": 1.1, "eval": 1.0}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, {"total_seconds": 530.0})}
    assert got["demo K=50 bf16: a round (train + eval, after the first)"] == "MET"  # median of 1.7 and 2.1: 1.9
    assert got["demo K=50 bf16: the rounds over their ideal (run_over_ideal)"] == "MET"
    assert got["demo K=50 bf16: set-up (process start → round 1)"] == "MISSED"  # the phase alone (8 s) is not it
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MET"
    assert got["SmolLM2-135M-shaped K=50 bf16: grouped over the careful bare loop (packed rows)"] == "MISSED"
    # the engine's packed rows (train.pack_tokens) measured in the same row: the faster layout is judged
    (tmp_path / "throughput_batched_smollm2-135m-bf16_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 120_000.0, "batched_packed_tokens_per_s": 151_000.0,
         "grouped_over_careful": 0.7, "grouped_packed_over_careful": 0.85}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, {"total_seconds": 530.0})}
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MET"
    assert got["SmolLM2-135M-shaped K=50 bf16: grouped over the careful bare loop (packed rows)"] == "MET"
    # the compiled layers (train.compile) measured in their own step's JSON: judged beside the two layouts
    (tmp_path / "throughput_batched_smollm2-135m-bf16_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 120_000.0, "batched_packed_tokens_per_s": 140_000.0}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, {"total_seconds": 530.0})}
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MISSED"
    (tmp_path / "throughput_batched_smollm2-135m-bf16-compiled_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 155_000.0}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, {"total_seconds": 530.0})}
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MET"
    assert got["Llama-3.1-8B-shaped K=16 bf16 step"] == "NOT MEASURED"
    assert got["the whole check"] == "MET"
    table = gpu_check.judgement_table(gpu_check.judge(tmp_path, {}))
    assert "MISSED" in table and "NOT MEASURED" in table and "≤ 540.00 s" in table
