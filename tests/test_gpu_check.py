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


def test_every_target_reads_a_step_of_its_own_and_the_compiled_step_runs_after_them(tmp_path):
    """Issue #93's plan: the round and set-up from a run without the ideal, the ideal from its own step, TF32
    and forked workers from steps that decide their GPU defaults, evaluation memory at the gpu-small shapes,
    CUDA equality of every GPU path; the compiled step after all of them (optional: it cannot take their
    time), the profile only with ``--profile``, last. The gating steps' limits sum to at most 480 s."""
    gpu_check = _gpu_check()
    default = gpu_check.steps(False, tmp_path)
    names = [name for name, *_ in default]
    assert names == ["smollm2-bf16", "llama8b-k16", "llama8b-plan", "smollm2-fp32", "smollm2-fp32-tf32",
                     "demo-round-k50", "demo-ideal-k50", "demo-forked-setup", "eval-memory", "equality-cuda",
                     "smollm2-bf16-compiled"]
    argv = {name: a for name, a, _, _ in default}
    env = {name: e for name, _, e, _ in default}
    assert set(gpu_check.GATING_STEPS) == set(names) - {"smollm2-bf16-compiled"}
    assert sum(limit for name, *_, limit in default if name in gpu_check.GATING_STEPS) <= gpu_check.GATING_LIMIT_S == 480
    assert "--no-ideal" in argv["demo-round-k50"] and "--ideal-of" in argv["demo-ideal-k50"]
    assert argv["demo-ideal-k50"][argv["demo-ideal-k50"].index("--ideal-of") + 1] == str(tmp_path / "run_demo-k50_k50.json")
    assert "train.tf32=true" in argv["smollm2-fp32-tf32"] and "train.tf32=false" in argv["smollm2-fp32"]
    assert env["demo-forked-setup"] == {"FEDSWEEP_WORKER_FORKS": "1"} and "eval.forwards=one" in argv["eval-memory"]
    assert env["equality-cuda"] == {"FEDSWEEP_TEST_DEVICE": "cuda"}
    for path in ("tests/test_packing.py", "tests/test_compiled.py", "tests/test_partial_sums.py",
                 "tests/test_stacked_evaluation.py::test_one_forward_evaluation_equals_evaluation_by_length",
                 "tests/test_lockstep.py"):
        assert path in argv["equality-cuda"], path
    assert "train.compile=inductor" in argv["smollm2-bf16-compiled"]
    assert all("--ops" not in a for a in argv.values())
    profiled = gpu_check.steps(False, tmp_path, profile=True)
    assert [name for name, *_ in profiled] == names + ["smollm2-bf16-profile"]
    dry = gpu_check.steps(False, tmp_path, dry=True)
    assert [name for name, *_ in dry] == names  # the rehearsal runs the same steps
    assert all("num_gpus=1" not in " ".join(a) for _, a, _, _ in dry)
    assert dict((n, e) for n, _, e, _ in dry)["equality-cuda"] == {"FEDSWEEP_TEST_DEVICE": "cpu"}
    assert gpu_check.machine_kind("NVIDIA H100 80GB HBM3") == "h100" and gpu_check.machine_kind("cpu") == "cpu"
    assert gpu_check.commit("abc1234") == "abc1234"


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
    assert len(configs) == 10 and all(any(s.startswith("model.name=random:") for s in c) for c in configs)


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


def test_the_check_judges_every_target_and_decides_the_defaults(tmp_path):
    """The targets are read from the run's own JSON: MET, MISSED, or NOT MEASURED where a step wrote
    nothing; the decisions from their two measurements."""
    import json

    gpu_check = _gpu_check()
    (tmp_path / "throughput_batched_smollm2-135m-bf16_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 160_000.0, "grouped_over_careful": 0.7}]}))
    (tmp_path / "run_demo-k50_k50.json").write_text(json.dumps({
        "run_over_ideal": 1.4, "phases_s": {"setup": 8.0}, "setup_s": 12.0,
        "per_round": [{"train": 5.0, "eval": 9.0}, {"train": 0.9, "eval": 0.8}, {"train": 1.1, "eval": 1.0}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, STEPS_DONE)}
    assert got["demo K=50 bf16: a round (train + eval, after the first)"] == "MET"  # median of 1.7 and 2.1: 1.9
    assert got["demo K=50 bf16: the rounds over their ideal (run_over_ideal, measured apart)"] == "MET"
    assert got["demo K=50 bf16: set-up (process start → round 1)"] == "MISSED"  # the phase alone (8 s) is not it
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MET"
    assert got["SmolLM2-135M-shaped K=50 bf16: grouped over the careful bare loop (packed rows)"] == "MISSED"
    # the engine's packed rows (train.pack_tokens) measured in the same row: the faster layout is judged
    (tmp_path / "throughput_batched_smollm2-135m-bf16_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 120_000.0, "batched_packed_tokens_per_s": 151_000.0,
         "grouped_over_careful": 0.7, "grouped_packed_over_careful": 0.85}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, STEPS_DONE)}
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MET"
    assert got["SmolLM2-135M-shaped K=50 bf16: grouped over the careful bare loop (packed rows)"] == "MET"
    # the compiled layers (train.compile) measured in their own step's JSON: judged beside the two layouts
    (tmp_path / "throughput_batched_smollm2-135m-bf16_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 120_000.0, "batched_packed_tokens_per_s": 140_000.0}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, STEPS_DONE)}
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MISSED"
    (tmp_path / "throughput_batched_smollm2-135m-bf16-compiled_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 155_000.0}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, STEPS_DONE)}
    assert got["SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)"] == "MET"
    assert got["Llama-3.1-8B-shaped K=16 bf16 step"] == "NOT MEASURED"
    assert got["the steps the targets read"] == "MET"  # 470 s of gating steps; the compiled step's 90 s not counted
    assert got["evaluation in one forward (gpu-small shapes): planned peak over measured"] == "NOT MEASURED"
    (tmp_path / "memory_eval-memory_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 16, "packed": {"planned_peak_bytes": 900, "peak_bytes": 1000}}]}))
    got = {r["target"]: r["verdict"] for r in gpu_check.judge(tmp_path, STEPS_DONE)}
    assert got["evaluation in one forward (gpu-small shapes): planned peak over measured"] == "MISSED"  # under-planned
    table = gpu_check.judgement_table(gpu_check.judge(tmp_path, {}))
    assert "MISSED" in table and "NOT MEASURED" in table and "≤ 480.00 s" in table
    assert [d["decided"] for d in gpu_check.decide(tmp_path)] == [None, None]
    (tmp_path / "throughput_batched_smollm2-135m-fp32_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 20_000.0}]}))
    (tmp_path / "throughput_batched_smollm2-135m-fp32-tf32_cuda.json").write_text(json.dumps({"rows": [
        {"clients": 50, "batched_tokens_per_s": 30_000.0}]}))
    (tmp_path / "run_demo-forked_k50.json").write_text(json.dumps({"setup_s": 12.5, "per_round": []}))
    tf32, forks = gpu_check.decide(tmp_path)
    assert tf32["ratio"] == 1.5 and tf32["decided"] == "on"
    assert forks["ratio"] == 12.0 / 12.5 and forks["decided"] == "off"


STEPS_DONE = {"steps": [{"step": "smollm2-bf16", "seconds": 300.0}, {"step": "demo-round-k50", "seconds": 170.0},
                        {"step": "smollm2-bf16-compiled", "seconds": 90.0}]}


def test_what_one_call_carries_fits_with_room():
    """Issue #93: the tree (tracked and untracked files git keeps), the wheels and the data ≤ 56 MiB, the
    wheels and data at their sizes as last built (the bundle itself refuses to build above the limit)."""
    import subprocess

    bundle = _tool("offline_bundle")
    try:
        tree = bundle.tree_bytes(ROOT)
    except (OSError, subprocess.CalledProcessError):
        import pytest

        pytest.skip("not a git checkout")
    total = tree + sum(bundle.MEASURED_BYTES.values())
    assert total <= bundle.LIMIT_BYTES == 56 * 2 ** 20, (tree, total)


README_GPU_FIGURES = [  # (what README writes, the JSON file of the cited raw folder, that text made from the JSON)
    ("8.6× on an H200", "throughput_batched_smollm2-135m-bf16_cuda.json",
     lambda j: f"{_row(j, 10)['batched_tokens_per_s'] / _row(j, 10)['sequential_tokens_per_s']:.1f}× on an H200"),
    ("16,873 against 1,970 tok/s", "throughput_batched_smollm2-135m-bf16_cuda.json",
     lambda j: f"{_row(j, 10)['batched_tokens_per_s']:,.0f} against {_row(j, 10)['sequential_tokens_per_s']:,.0f} tok/s"),
    ("0.64× (58,837 tok/s against the bare loop's 91,692", "throughput_batched_smollm2-135m-bf16_cuda.json",
     lambda j: f"{_row(j, 50)['grouped_over_bare']:.2f}× ({_row(j, 50)['batched_tokens_per_s']:,.0f} tok/s against the "
               f"bare loop's {_row(j, 50)['bare_tokens_per_s']:,.0f}"),
    ("1.05× (5,495 tok/s)", "throughput_batched_llama-3.1-8b-k16_cuda.json",
     lambda j: f"{_row(j, 16)['grouped_over_bare']:.2f}× ({_row(j, 16)['batched_tokens_per_s']:,.0f} tok/s)"),
    ("the demo's K = 50 round took 6.8 s, of which the actor trained 0.87 s", "run_demo-k50_k50.json",
     lambda j: f"the demo's K = 50 round took {j['per_round'][1]['round']:.1f} s, of which the actor trained "
               f"{j['per_round'][1]['busiest_actor_train']:.2f} s"),
]
"""Every GPU figure README quotes, beside the JSON it comes from (``benchmarks/raw/2026-11-28-h200/``,
kept in git's history: ``benchmarks/manifest.json``)."""


def _row(result: dict, k: int) -> dict:
    return next(r for r in result["rows"] if r["clients"] == k)


def test_readme_quotes_its_gpu_figures_as_their_json_has_them():
    """Issue #93: README's GPU figures are the JSON they cite, rounded as README writes them."""
    import json

    import pytest

    from fedsweep.bench import evidence

    readme = (ROOT / "README.md").read_text()
    listed = {f["path"]: f["commit"] for f in evidence.load(ROOT)["files"]}
    raw = "benchmarks/raw/2026-11-28-h200/results.json"
    data = evidence.read_back(ROOT, listed[raw], raw) if raw in listed else None
    if data is None:
        pytest.skip("a clone without the history the manifest points into")
    files = json.loads(data)["files"]
    for quoted, name, made in README_GPU_FIGURES:
        assert quoted in readme, f"README no longer quotes {quoted!r}: update README_GPU_FIGURES with it"
        assert made(files[name]) == quoted, (made(files[name]), quoted)
