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


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


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


def steps(quick: bool, out: Path, profile: bool = False) -> list[tuple[str, list[str], dict, int]]:
    """(name, argv, extra environment, seconds allowed) of each step, in order; the profile last and only
    when asked for."""
    fed = [sys.executable, "-m", "fedsweep.cli"]
    ks = "1,10" if quick else "1,10,50"
    reps = ["--repeats", "1"] if quick else ["--repeats", "3"]
    bench = fed + ["bench", "throughput", DEMO, "--set", "train.batch_clients=auto", "--out", str(out)]
    llama = bench + LLAMA + ["--set", "name=llama-3.1-8b-k16", "--set", "data.examples_per_task=64",
                             "--set", "train.steps=2", "--clients", "4" if quick else "16",
                             "--sequential-max", "0"] + reps  # 16 8B clients one at a time: 40 s a round
    profiled = [("smollm2-bf16-profile", bench + SMOL + BF16 + ["--set", "name=smollm2-135m-bf16-profile", "--ops",
                                                              "--clients", "10" if quick else "50"], {}, 200)]
    return [
        ("smollm2-bf16", bench + SMOL + BF16 + ["--set", "name=smollm2-135m-bf16", "--clients", ks,
                                                "--sequential-max", "10", "--padding-free"] + reps, {}, 125),
        ("smollm2-bf16-compiled", bench + SMOL + BF16 + ["--set", "name=smollm2-135m-bf16-compiled",
                                                         "--set", "train.compile=inductor", "--clients",
                                                         "10" if quick else "50", "--sequential-max", "0"] + reps,
         {}, 55),  # (never run yet: its limit comes from the demo round's and the planner's, which measured far under theirs)
        ("llama8b-k16", llama, {}, 65),  # (46 s on the H200, 2026-11-28; the SmolLM2 step took 67 s before it measured the careful loop and packed rows too)
        ("llama8b-plan", fed + ["plan", DEMO] + LLAMA + ["--set", "train.batch_clients=auto",
                                                          "--set", "clients.num_clients=16",
                                                          "--set", "clients.clients_per_actor=16",
                                                          "--gpu-memory", "80GB"], {}, 20),
        ("smollm2-fp32", bench + SMOL + ["--set", "train.autocast=none", "--set", "name=smollm2-135m-fp32",
                                          "--clients", ks, "--sequential-max", "10", "--padding-free"] + reps, {}, 75),
        ("demo-round-k50", fed + ["bench", "run", DEMO] + SMOL + BF16 + [
            "--set", "name=demo-k50", "--set", f"clients.num_clients={10 if quick else 50}",
            "--set", f"clients.clients_per_actor={10 if quick else 50}", "--set", "train.batch_clients=auto",
            "--set", "rounds=3", "--set", "tracking.enabled=false", "--out", str(out)], {}, 80),
        ("lockstep-equality-cuda", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                    "tests/test_lockstep.py"], {"FEDSWEEP_TEST_DEVICE": "cuda"}, 50),
        ("gpu-tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider"] + gpu_test_files(),
         {}, 70),
    ] + (profiled if profile else [])


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


LIMIT_S = 540
"""The whole check's time: one call of the device tool (its steps' limits sum to at most this)."""


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


TARGETS = [  # (what, reads the folder and summary -> value or None, at most (False) / at least (True), bound, unit)
    ("demo K=50 bf16: a round (train + eval, after the first)",
     lambda f, s: _later_rounds(_demo(f), lambda r: r["train"] + r["eval"]), False, 2.0, "s"),
    ("demo K=50 bf16: the rounds over their ideal (run_over_ideal)",
     lambda f, s: (_demo(f) or {}).get("run_over_ideal"), False, 1.5, "×"),
    ("demo K=50 bf16: set-up (process start → round 1)", lambda f, s: _setup(_demo(f)), False, 10.0, "s"),
    ("SmolLM2-135M-shaped K=50 bf16 step (padded, packed or compiled, the fastest)",
     lambda f, s: _best({**_rows(f, "smollm2-135m-bf16").get(50, {}),
                         "compiled": _rows(f, "smollm2-135m-bf16-compiled").get(50, {}).get("batched_tokens_per_s")},
                        "batched_tokens_per_s", "batched_packed_tokens_per_s", "compiled"), True, 150_000.0, "tok/s"),
    ("SmolLM2-135M-shaped K=50 bf16: grouped over the careful bare loop (packed rows)",
     lambda f, s: _best(_rows(f, "smollm2-135m-bf16").get(50, {}), "grouped_over_careful",
                        "grouped_packed_over_careful"), True, 0.8, "×"),
    ("Llama-3.1-8B-shaped K=16 bf16 step", lambda f, s: _rows(f, "llama-3.1-8b-k16").get(16, {}).get(
        "batched_tokens_per_s"), True, 7_000.0, "tok/s"),
    ("the whole check", lambda f, s: s.get("total_seconds"), False, float(LIMIT_S), "s"),
]
"""What ``make gpu-check`` judges (the issue's targets for a study on a GPU at the speed of its work)."""


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
    args = ap.parse_args(argv)
    if args.bundle:  # this process (software()) and every step see the bundle
        extra = bundle(ROOT, Path(args.site))
        if "PYTHONPATH" in extra:
            sys.path[:0] = extra["PYTHONPATH"].split(os.pathsep)
            extra["PYTHONPATH"] = os.pathsep.join(p for p in (extra["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)
        os.environ.update(extra)
        print(f"bundle: {extra}", flush=True)
    name = device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = ROOT / args.out / f"{time.strftime('%Y-%m-%d-%H%M%S')}-{slug}"  # a fresh folder: no earlier JSON in it
    out.mkdir(parents=True, exist_ok=False)
    console = open(out / "console.log", "w")

    def say(text: str) -> None:
        print(text, flush=True)
        console.write(text + "\n")
        console.flush()
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    summary = {"device": name, "nvidia_smi": nvidia_smi(), "software": software(), "commit": commit(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": []}
    only = set(args.only.split(",")) if args.only else None
    t_all = time.perf_counter()
    for step, cmd, extra, limit in steps(args.quick, out, profile=args.profile or bool(only and "smollm2-bf16-profile" in only)):
        if only and step not in only:
            continue
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
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [s["step"] for s in summary["steps"] if s["rc"] != 0]
    missed = [t["target"] for t in summary["targets"] if t["verdict"] != "MET"]
    say(f"gpu-check: {len(summary['steps']) - len(failed)} of {len(summary['steps'])} steps passed in "
        f"{summary['total_seconds']} s → {out}" + (f"; failed: {', '.join(failed)}" if failed else "")
        + f"; {len(summary['targets']) - len(missed)} of {len(summary['targets'])} targets met")
    console.close()
    pack(out, args.tar)
    if args.raw:
        raw = ROOT / "benchmarks" / "raw" / f"{time.strftime('%Y-%m-%d')}-{slug}-gpu-check"
        shutil.copytree(out, raw, dirs_exist_ok=True)
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
