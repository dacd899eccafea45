"""``make gpu-check``: every GPU figure of the project in one command (about 6 minutes on one H200).

Runs, one after another, each in its own process with its own time limit (a step that fails or runs
over is recorded and the next one starts), the headline figures first:

1. ``fedsweep bench throughput`` of 1, 10 and 50 packed SmolLM2-135M-shaped clients (random weights,
   the demo's batches of 4, 2 steps a round), grouped against the bare transformers + peft loop on
   the same rows (the ceiling) and, up to K = 10, one at a time; bf16 base with bf16 autocast; with
   ``--padding-free``, the bare loop over the same sequences without padding too (what a padding-free
   forward would buy), the careful bare loop, and the grouped step with its own packed rows
   (``train.pack_tokens``): the step targets read the faster of the engine's two layouts;
2. the same K = 50 grouped step with its decoder layers compiled (``train.compile=inductor``: the
   first round traces and compiles, the repeats time it); the step target reads it too;
3. ``fedsweep bench throughput`` and ``fedsweep plan`` of 16 packed Llama-3.1-8B-shaped clients
   (bf16, LoRA r = 16, gradient checkpointing, 256 tokens);
4. the SmolLM2 bench in fp32;
5. the demo's round at K = 50 (``bench run``): each round's time and its parts;
6. the lockstep equality tests on CUDA (``FEDSWEEP_TEST_DEVICE=cuda pytest tests/test_lockstep.py``)
   and the GPU tests (``pytest -m gpu``);
7. only with ``--profile`` (``make gpu-profile``; about 2.5 more minutes): ``bench throughput --ops`` of
   K = 50 (bf16) on the GPU: operator calls, and a ``torch.profiler`` trace of the grouped round and of
   the bare loop (kernels, their device time, busy share, top kernels). It is the slowest step (155 s
   of the 495 s the H200 check of 2026-11-28 took) and a diagnosis, not a figure the targets read,
   so the default check leaves it out.

Everything lands in one dated folder named after the device, ``results/gpu/<date>-<device>/``: each
step's log and JSON, ``ratios.txt`` (the table printed last: grouped over bare per workload and K),
and ``summary.json`` (device, software, per step its command, exit status and
seconds). With ``--tar PATH`` the folder is also packed into one archive (the device tool brings back
at most 8 files). ``--quick`` runs K = 1, 10 only and one repeat: a smoke test of the script itself.
``--bundle``: on a node without network, first install ``make offline-bundle``'s wheels (``.whl/``)
and point every step at its data cache (``.devdata/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = "configs/experiments/demo.yaml"
SMOL = ["--set", "model.name=random:smollm2-135m-instruct", "--set", "clients.resources.num_gpus=1",
        "--set", "data.examples_per_task=160", "--set", "train.steps=2"]
BF16 = ["--set", "model.dtype=bf16", "--set", "train.autocast=bf16"]
LLAMA = ["--set", "model.name=random:llama-3.1-8b", "--set", "model.dtype=bf16", "--set", "train.autocast=bf16",
         "--set", "lora.r=16", "--set", "train.gradient_checkpointing=true", "--set", "train.max_length=256",
         "--set", "clients.resources.num_gpus=1"]


def commit(given: str | None = None) -> str:
    """The commit the check runs: ``given`` (``--commit``, or ``FEDSWEEP_COMMIT``: a node handed the tree
    without ``.git``), else git's HEAD, else "unknown"."""
    given = given or os.environ.get("FEDSWEEP_COMMIT")
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_kind(device: str) -> str:
    """The device as the raw folders name it (``benchmarks/raw/<date>-<kind>-…``): h100, h200, a100 or cpu;
    another GPU by its name's letters and digits."""
    low = device.lower()
    for kind in ("h100", "h200", "a100"):
        if kind in low:
            return kind
    return "cpu" if low == "cpu" else re.sub(r"[^a-z0-9]+", "-", low).strip("-")


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - a machine without torch still gets a folder
        pass
    return "cpu"


def software() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("torch", "transformers", "peft", "ray", "mlflow"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            out[mod] = f"missing ({type(exc).__name__})"
    return out


def gpu_test_files() -> list[str]:
    """The test modules with tests marked ``gpu`` (collecting the others would import what a bare GPU node
    lacks, e.g. MLflow)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


TINY = ["--set", "model.name=tiny", "--set", "clients.resources.num_gpus=0", "--set", "data.examples_per_task=24",
        "--set", "train.steps=2"]
"""``--dry``'s stand-in for the GPU shapes: the bundled tiny model on the CPU (every step's code, the CPU's sizes)."""
TINY_LLAMA = ["--set", "model.name=tiny", "--set", "lora.r=16", "--set", "train.gradient_checkpointing=true",
              "--set", "train.max_length=96", "--set", "clients.resources.num_gpus=0"]


def steps(quick: bool, out: Path, profile: bool = False, dry: bool = False) -> list[tuple[str, list[str], dict, int]]:
    """(name, argv, extra environment, seconds allowed) of each step, in order: every target read from a
    step of its own (the round and set-up from a run that does not also measure the ideal; the ideal
    from its own step), the optional compiled step after every step a target needs (it cannot take
    their time), the profile last and only when asked for. ``dry``: the same steps with the CPU's
    shapes (``make gpu-check-dry``: a rehearsal of the code, its JSON, folder and judgement)."""
    fed = [sys.executable, "-m", "fedsweep.cli"]
    big = DRY_K if dry else 50
    ks = "1,2" if dry else ("1,10" if quick else "1,10,50")
    reps = ["--repeats", "1"] if quick or dry else ["--repeats", "3"]
    smol, bf16, llama_shape = (TINY, [], TINY_LLAMA) if dry else (SMOL, BF16, LLAMA)
    bench = fed + ["bench", "throughput", DEMO, "--set", "train.batch_clients=auto", "--out", str(out)]
    llama = bench + llama_shape + ["--set", "name=llama-3.1-8b-k16", "--set", "data.examples_per_task=64",
                                   "--set", "train.steps=2", "--clients", str(DRY_LLAMA_K) if dry else ("4" if quick else "16"),
                                   "--sequential-max", "0"] + reps  # 16 8B clients one at a time: 40 s a round
    demo = fed + ["bench", "run", DEMO] + smol + bf16 + [
        "--set", "name=demo-k50", "--set", f"clients.num_clients={big}", "--set", f"clients.clients_per_actor={big}",
        "--set", "train.batch_clients=auto", "--set", "rounds=3", "--set", "tracking.enabled=false"]
    demo_json = out / f"run_demo-k50_k{big}.json"
    forked = fed + ["bench", "run", DEMO] + smol + bf16 + [
        "--set", "name=demo-forked", "--set", f"clients.num_clients={big}", "--set", f"clients.clients_per_actor={big}",
        "--set", "train.batch_clients=auto", "--set", "rounds=1", "--set", "tracking.enabled=false", "--no-ideal",
        "--out", str(out)]
    gpu_small = ["--set", "model.name=tiny" if dry else "model.name=random:smollm2-135m-instruct",
                 "--set", f"clients.resources.num_gpus={0 if dry else 1}", "--set", "eval.forwards=one",
                 "--set", "eval.max_new_tokens=8", "--set", "train.steps=1"]
    equality = ["tests/test_lockstep.py", "tests/test_packing.py", "tests/test_compiled.py", "tests/test_partial_sums.py",
                "tests/test_stacked_evaluation.py::test_one_forward_evaluation_equals_evaluation_by_length"]
    profiled = [("smollm2-bf16-profile", bench + SMOL + BF16 + ["--set", "name=smollm2-135m-bf16-profile", "--ops",
                                                              "--clients", "10" if quick else "50"], {}, 200)]
    compiled = [("smollm2-bf16-compiled", bench + smol + bf16 + [
        "--set", "name=smollm2-135m-bf16-compiled", "--set", f"train.compile={'aot_eager' if dry else 'inductor'}",
        "--clients", str(big), "--sequential-max", "0"] + reps, {}, COMPILED_LIMIT_S)]
    return [
        # the K = 50 step and the careful-loop ratio (1,10,50 packed and padded; 67 s on the H200 of 11-28
        # before it also measured the careful loop and packed rows)
        ("smollm2-bf16", bench + smol + bf16 + ["--set", "name=smollm2-135m-bf16", "--clients", ks,
                                                "--sequential-max", "2" if dry else "10", "--padding-free"] + reps,
         {}, 100),
        ("llama8b-k16", llama, {}, 60),  # (46 s on the H200, 2026-11-28)
        ("llama8b-plan", fed + ["plan", DEMO] + llama_shape + [
            "--set", "train.batch_clients=auto", "--set", "clients.num_clients=16", "--set", "clients.clients_per_actor=16",
            "--gpu-memory", "80GB"], {}, 15),
        # fp32 with TF32 off and on, K = 50 each: train.tf32's GPU default is the faster at equal loss
        ("smollm2-fp32", bench + smol + ["--set", "train.autocast=none", "--set", "train.tf32=false",
                                          "--set", "name=smollm2-135m-fp32", "--clients", str(big),
                                          "--sequential-max", "0"] + reps, {}, 35),
        ("smollm2-fp32-tf32", bench + smol + ["--set", "train.autocast=none", "--set", "train.tf32=true",
                                               "--set", "name=smollm2-135m-fp32-tf32", "--clients", str(big),
                                               "--sequential-max", "0"] + reps, {}, 35),
        # the round and the set-up (no ideal in this process), then the ideal of the same rounds apart
        ("demo-round-k50", demo + ["--no-ideal", "--out", str(out)], {}, 70),
        ("demo-ideal-k50", fed + ["bench", "run", DEMO, "--ideal-of", str(demo_json)], {}, 35),
        # the same run's set-up with Ray's workers forked (the fork server's GPU default)
        ("demo-forked-setup", forked, {"FEDSWEEP_WORKER_FORKS": "1"}, 35),
        # evaluation in one forward at the gpu-small shapes: the planner against the measured peak
        ("eval-memory", fed + ["bench", "memory", DEMO] + gpu_small + bf16 + [
            "--set", "name=eval-memory", "--clients", "4" if dry else "16", "--separate-max", "1", "--out", str(out)],
         {}, 30),
        # CUDA equality of every GPU path against the eager, padded, per-client one, and the gpu tests
        ("equality-cuda", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-m", "not long and not system", *(DRY_EQUALITY if dry else [*equality, *gpu_test_files()])],
         {"FEDSWEEP_TEST_DEVICE": "cpu" if dry else "cuda"}, 60),
    ] + compiled + (profiled if profile and not dry else [])


DRY_K, DRY_LLAMA_K = 4, 2
"""``--dry``'s K for the SmolLM2 workloads and the Llama one (the device's: 50 and 16)."""
DRY_EQUALITY = ["tests/test_partial_sums.py", "-k", "weighted_mean or equals_each_upload"]
"""``--dry``'s equality step: the step run through pytest as on the device, on a few of its CPU tests (all of
them run in ``make test``)."""
DRY_SLOWER = 3
"""``--dry``'s limits: a device step's limit × this (2 CPU cores at the CPU's shapes)."""


COMPILED_LIMIT_S = 55
"""The compiled step's limit: never timed on a device yet (an inductor compile on a cold cache). It runs
after every step a target needs, so that it cannot make another NOT MEASURED; once a device timed it, this
becomes that time × 1.5."""
GATING_LIMIT_S = 480
"""What the steps the targets read may take together (the device tool's call, with room for the start)."""


def ratio_table(folder: Path) -> str:
    """One table of every grouped-throughput row measured in ``folder``: grouped tok/s beside the bare
    loop's on the same rows (the ceiling), their ratio, one at a time, MFU, and where measured
    (``--padding-free``) the bare loop without padding over the padded one."""
    lines = [f"{'workload':<24} {'K':>3} {'grouped tok/s':>14} {'bare tok/s':>12} {'grouped/bare':>13} "
             f"{'one at a time':>14} {'grouped MFU':>12} {'bare padding-free/bare':>23}"]
    for path in sorted(folder.glob("throughput_batched_*.json")):
        result = json.loads(path.read_text())
        name = path.stem.removeprefix("throughput_batched_").rsplit("_", 1)[0]
        for row in result["rows"]:
            mfu, one, free = row.get("batched_mfu"), row.get("sequential_tokens_per_s"), row.get("bare_padding_free_over_bare")
            lines.append(f"{name:<24} {row['clients']:>3} {row['batched_tokens_per_s']:>14,.0f} "
                         f"{row.get('bare_tokens_per_s', float('nan')):>12,.0f} {row.get('grouped_over_bare', float('nan')):>12.2f}× "
                         f"{(f'{one:,.0f}' if one is not None else '—'):>14} {(f'{mfu:.1%}' if mfu is not None else '—'):>12} "
                         f"{(f'{free:.2f}×' if free is not None else '—'):>23}")
    return "\n".join(lines)


def round_table(folder: Path) -> str:
    """Per ``bench run`` measured in ``folder`` (the demo's round at K = 50): each round's seconds and its
    parts (training, evaluation, aggregation, checkpoint, the rest), the first round's warm-up included."""
    lines = []
    for path in sorted(folder.glob("run_*.json")):
        result = json.loads(path.read_text())
        lines.append(f"{result['name']}: {result['clients']} clients, {result['num_actors']} actor(s); setup "
                     f"{result['phases_s']['setup']:.1f} s")
        for i, r in enumerate(result["per_round"], start=1):
            lines.append(f"  round {i}: {r['round']:7.2f} s = train {r['train']:.2f} · eval {r['eval']:.2f} · "
                         f"aggregate {r['aggregation']:.3f} · checkpoint {r['checkpoint']:.3f} · rest {r['overhead']:.3f}")
    return "\n".join(lines)


def profile_table(folder: Path) -> str:
    """Per K profiled (``bench throughput --ops`` on the GPU): the grouped round and the bare loop on the
    same rows, their wall time, kernels, the kernels' device time and the share of the round it fills."""
    lines = []
    for path in sorted(folder.glob("throughput_ops_*.json")):
        for row in json.loads(path.read_text())["rows"]:
            for name, g in row.get("gpu", {}).items():
                lines.append(f"K={row['clients']:<3} {name:<8} round {g['round_seconds'] * 1e3:9.1f} ms  "
                             f"{g['kernels']:>7,} kernels  {g['kernel_seconds'] * 1e3:8.1f} ms on the GPU "
                             f"({g['busy_share']:.0%} busy); aten calls {row['round_aten_calls']:,}")
    return "\n".join(lines)


def _rows(folder: Path, name: str) -> dict[int, dict]:
    out = {}
    for path in folder.glob(f"throughput_batched_{name}_*.json"):
        out.update({row["clients"]: row for row in json.loads(path.read_text())["rows"]})
    return out


def _best(row: dict, *keys: str) -> float | None:
    """The largest of ``row``'s measured ``keys`` (the engine's step with padded and with packed rows,
    ``train.pack_tokens``, and with compiled layers, ``train.compile``: each setting's GPU default is the
    faster one); None if none was measured."""
    values = [row[k] for k in keys if row.get(k) is not None]
    return max(values) if values else None


def _demo(folder: Path) -> dict | None:
    paths = sorted(folder.glob("run_demo-k50_*.json")) or sorted(folder.glob("run_*.json"))
    return json.loads(paths[-1].read_text()) if paths else None


def _setup(run: dict | None) -> float | None:
    """Process start → round 1 (``setup_s``); a JSON from before 2026-11-30 has only its ``setup`` phase,
    which leaves out the driver's imports and Ray's start, and is not taken for it."""
    return (run or {}).get("setup_s")


def _later_rounds(run: dict | None, key) -> float | None:
    """The median over the rounds after the first (its warm-up is the set-up's) of ``key(round)``."""
    if not run or len(run["per_round"]) < 2:
        return None
    import statistics

    return statistics.median(key(r) for r in run["per_round"][1:])


def _run_json(folder: Path, name: str) -> dict | None:
    paths = sorted(folder.glob(f"run_{name}_*.json"))
    return json.loads(paths[-1].read_text()) if paths else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _eval_memory(folder: Path) -> float | None:
    """The planner's peak over the measured one, evaluation in one forward at the gpu-small shapes (≥ 1:
    the planner does not under-plan)."""
    paths = sorted(folder.glob("memory_eval-memory*.json")) or sorted(folder.glob("*eval-memory*.json"))
    if not paths:
        return None
    row = json.loads(paths[-1].read_text())["rows"][-1]["packed"]
    return _ratio(row["planned_peak_bytes"], row["peak_bytes"])


def _k(summary: dict, workload: str = "smollm2", default: int = 50) -> int:
    """The K a target reads: the device's (50; the Llama workload's 16), or the rehearsal's smaller one
    (``summary["k"]``, written by ``--dry``)."""
    return (summary.get("k") or {}).get(workload, default)


def _gating_seconds(summary: dict) -> float | None:
    done = [s["seconds"] for s in summary.get("steps", []) if s["step"] in GATING_STEPS]
    return sum(done) if done else None


GATING_STEPS = ("smollm2-bf16", "llama8b-k16", "llama8b-plan", "smollm2-fp32", "smollm2-fp32-tf32", "demo-round-k50",
                "demo-ideal-k50", "demo-forked-setup", "eval-memory", "equality-cuda")
"""The steps a target or a decision reads (their limits sum to at most :data:`GATING_LIMIT_S`)."""

TARGETS = [  # (what, reads the folder and summary -> value or None, at most (False) / at least (True), bound, unit)
    ("demo K=50 bf16: a round (train + eval, after the first)",
     lambda f, s: _later_rounds(_demo(f), lambda r: r["train"] + r["eval"]), False, 2.0, "s"),
    ("demo K=50 bf16: the rounds over their ideal (run_over_ideal, measured apart)",
     lambda f, s: (_demo(f) or {}).get("run_over_ideal"), False, 1.5, "×"),
    ("demo K=50 bf16: set-up (process start → round 1)", lambda f, s: _setup(_demo(f)), False, 10.0, "s"),
    ("SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)",
     lambda f, s: _best({**_rows(f, "smollm2-135m-bf16").get(_k(s), {}),
                         "compiled": _rows(f, "smollm2-135m-bf16-compiled").get(_k(s), {}).get("batched_tokens_per_s")},
                        "batched_tokens_per_s", "batched_packed_tokens_per_s", "compiled"), True, 150_000.0, "tok/s"),
    ("SmolLM2-135M-shaped K=50 bf16: grouped over the careful bare loop (packed rows)",
     lambda f, s: _best(_rows(f, "smollm2-135m-bf16").get(_k(s), {}), "grouped_over_careful",
                        "grouped_packed_over_careful"), True, 0.8, "×"),
    ("Llama-3.1-8B-shaped K=16 bf16 step", lambda f, s: _rows(f, "llama-3.1-8b-k16").get(_k(s, "llama", 16), {}).get(
        "batched_tokens_per_s"), True, 7_000.0, "tok/s"),
    ("evaluation in one forward (gpu-small shapes): planned peak over measured", lambda f, s: _eval_memory(f),
     True, 1.0, "×"),
    ("the steps the targets read", lambda f, s: _gating_seconds(s), False, float(GATING_LIMIT_S), "s"),
]
"""What ``make gpu-check`` judges (the issue's targets for a study on a GPU at the speed of its work)."""


DECISIONS = [  # (setting, reads the folder -> the ratio of the setting on over off, what the ratio decides)
    ("train.tf32 (fp32 K=50: TF32 over without)",
     lambda f: _ratio(*(max((r.get("batched_tokens_per_s") or 0.0 for r in _rows(f, name).values()), default=None)
                        for name in ("smollm2-135m-fp32-tf32", "smollm2-135m-fp32"))),
     "on where > 1.05 (and the loss equal to bf16's tolerance)"),
    ("forked workers (demo K=50 set-up: unforked over forked)",
     lambda f: _ratio(_setup(_demo(f)), _setup(_run_json(f, "demo-forked"))), "on where > 1.05"),
]
"""The GPU defaults a window decides: each a measured ratio; the rule that turns it into the default."""


def decide(folder: Path) -> list[dict]:
    out = []
    for what, read, rule in DECISIONS:
        try:
            value = read(folder)
        except (OSError, ValueError, KeyError, TypeError):
            value = None
        out.append({"setting": what, "ratio": value, "rule": rule,
                    "decided": None if value is None else ("on" if value > 1.05 else "off")})
    return out


def judge(folder: Path, summary: dict) -> list[dict]:
    """Each target: its measured value and MET, MISSED or NOT MEASURED."""
    out = []
    for what, read, at_least, bound, unit in TARGETS:
        try:
            value = read(folder, summary)
        except (OSError, ValueError, KeyError, TypeError):
            value = None
        verdict = "NOT MEASURED" if value is None else \
            ("MET" if (value >= bound if at_least else value <= bound) else "MISSED")
        out.append({"target": what, "value": value, "bound": bound, "at_least": at_least, "unit": unit,
                    "verdict": verdict})
    return out


def judgement_table(rows: list[dict]) -> str:
    lines = [f"{'target':<78} {'measured':>14} {'bound':>14}  verdict"]
    for r in rows:
        value = "—" if r["value"] is None else f"{r['value']:,.2f} {r['unit']}"
        bound = f"{'≥' if r['at_least'] else '≤'} {r['bound']:,.2f} {r['unit']}"
        lines.append(f"{r['target']:<78} {value:>14} {bound:>14}  {r['verdict']}")
    return "\n".join(lines)


def pack(folder: Path, tar_path: str | None) -> None:
    if tar_path:
        with tarfile.open(tar_path, "w:gz") as tar:
            tar.add(folder, arcname=folder.name)


def nvidia_smi() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def bundle(root: Path, site: Path) -> dict[str, str]:
    """``make offline-bundle``'s folders put to use on a node without network: the wheels of ``.whl/``
    installed into ``site`` (pip ``--target``, no index, no dependencies), and the environment that
    lets every step see them, the stub distribution and the data cache of ``.devdata/``."""
    wheels = sorted((root / ".whl").glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    data = root / ".devdata"
    paths = ([str(site)] if wheels else []) + ([str(data / "site")] if (data / "site").is_dir() else [])
    return {**({"PYTHONPATH": os.pathsep.join(paths)} if paths else {}),
            **({"FEDSWEEP_CACHE": str(data)} if data.is_dir() else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gpu", help="parent folder (default results/gpu)")
    ap.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="K = 1, 10 and one repeat: checks the script, not the GPU")
    ap.add_argument("--tar", default=None, help="also pack the folder into this .tar.gz")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the K = 50 grouped round and the bare loop (about 2.5 more minutes)")
    ap.add_argument("--bundle", action="store_true",
                    help="a node without network: install .whl/ into --site and use .devdata/ (make offline-bundle)")
    ap.add_argument("--site", default="/tmp/fedsweep-site", help="where --bundle installs the wheels")
    ap.add_argument("--strict", action="store_true", help="exit 1 where a target is missed or not measured")
    ap.add_argument("--raw", action="store_true",
                    help="also copy the folder to benchmarks/raw/<date>-<device>-gpu-check/ (its summary names the commit)")
    ap.add_argument("--dry", action="store_true",
                    help="a rehearsal on the CPU (make gpu-check-dry): every step with the CPU's shapes, the same "
                         "JSON, folder and judgement")
    ap.add_argument("--commit", default=None, help="the commit the tree is at, where it has no .git (recorded)")
    args = ap.parse_args(argv)
    if args.bundle:  # this process (software()) and every step see the bundle
        extra = bundle(ROOT, Path(args.site))
        if "PYTHONPATH" in extra:
            sys.path[:0] = extra["PYTHONPATH"].split(os.pathsep)
            extra["PYTHONPATH"] = os.pathsep.join(p for p in (extra["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)
        os.environ.update(extra)
        print(f"bundle: {extra}", flush=True)
    name = "cpu" if args.dry else device_name()
    slug = machine_kind(name)
    what = "gpu-check-dry" if args.dry else "gpu-check"
    out = ROOT / args.out / f"{time.strftime('%Y-%m-%d')}-{slug}-{what}-{time.strftime('%H%M%S')}"  # fresh: no earlier JSON
    out.mkdir(parents=True, exist_ok=False)
    console = open(out / "console.log", "w")

    def say(text: str) -> None:
        print(text, flush=True)
        console.write(text + "\n")
        console.flush()
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    summary = {"device": name, "nvidia_smi": None if args.dry else nvidia_smi(), "software": software(),
               "commit": commit(args.commit), "dry": args.dry, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "k": {"smollm2": DRY_K, "llama": DRY_LLAMA_K} if args.dry else {"smollm2": 50, "llama": 16},
               "steps": []}
    only = set(args.only.split(",")) if args.only else None
    t_all = time.perf_counter()
    plan = steps(args.quick, out, profile=args.profile or bool(only and "smollm2-bf16-profile" in only), dry=args.dry)
    for step, cmd, extra, limit in plan:
        if only and step not in only:
            continue
        limit = limit * DRY_SLOWER if args.dry else limit
        say(f"== {step} (≤ {limit} s): {' '.join(cmd[2:])}")
        t0 = time.perf_counter()
        log = out / f"{step}.log"
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env={**env, **extra}, stdout=fh, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        seconds = round(time.perf_counter() - t0, 1)
        tail = log.read_text(errors="replace").splitlines()[-6:]
        summary["steps"].append({"step": step, "command": cmd[2:], "env": extra, "rc": rc, "seconds": seconds})
        say(f"   rc={rc} in {seconds} s\n   " + "\n   ".join(tail))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        pack(out, args.tar)  # after every step: a call cut short still brings back what it measured
    summary["total_seconds"] = round(time.perf_counter() - t_all, 1)
    table = "\n\n".join(part for part in (ratio_table(out), profile_table(out), round_table(out)) if part)
    (out / "ratios.txt").write_text(table + "\n")
    say(table)
    summary["targets"] = judge(out, summary)
    say(judgement_table(summary["targets"]))
    summary["decisions"] = decide(out)
    for d in summary["decisions"]:
        ratio = "—" if d["ratio"] is None else f"{d['ratio']:.3f}"
        say(f"{d['setting']}: {ratio} → {d['decided'] or 'NOT MEASURED'} ({d['rule']})")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [s["step"] for s in summary["steps"] if s["rc"] != 0]
    missed = [t["target"] for t in summary["targets"] if t["verdict"] != "MET"]
    say(f"gpu-check: {len(summary['steps']) - len(failed)} of {len(summary['steps'])} steps passed in "
        f"{summary['total_seconds']} s → {out}" + (f"; failed: {', '.join(failed)}" if failed else "")
        + f"; {len(summary['targets']) - len(missed)} of {len(summary['targets'])} targets met")
    console.close()
    pack(out, args.tar)
    raw = ROOT / "benchmarks" / "raw" / f"{time.strftime('%Y-%m-%d')}-{slug}-{what}"
    if args.raw:
        shutil.copytree(out, raw, dirs_exist_ok=True)
    print(f"to commit it: python3 tools/gpu_check.py --raw … (or cp -r {out} {raw}); then\n"
          f"  git add {raw.relative_to(ROOT)} && git commit -m 'gpu-check on {name} at {summary['commit'][:7]}'",
          flush=True)
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
