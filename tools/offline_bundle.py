"""``make offline-bundle``: what a GPU node without network needs to run ``make gpu-check``.

A GPU node often has its own Python with torch, transformers and peft and nothing else of this project,
and no way to fetch packages or generate data. This builds, on a machine with a package registry and the
project's environment:

- ``.whl/``: the wheels of the packages such a node lacks (:data:`CARRIED`, at the versions installed
  here, for the node's Python: ``--python-version``, default 3.12), Ray's stripped of what a check never
  loads (its Java jars, the dashboard's web build, source maps), so the bundle stays small;
- ``.devdata/``: the generated-data cache (``$FEDSWEEP_CACHE/data``): the records of every config
  ``make gpu-check`` runs, prepared here, plus whatever this machine's cache already holds (the test
  suite's); and ``.devdata/site/``, a stub ``reasoning_gym`` distribution whose only content is its
  version, which the cache's keys read (the package itself and its dependencies stay behind).

On the node, ``python3 tools/gpu_check.py --bundle``, or by hand::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD/.devdata/site FEDSWEEP_CACHE=$PWD/.devdata python3 tools/gpu_check.py

Both folders are ignored by git. The sizes are printed: a transfer limit (64 MiB on some lent machines)
may decide what travels.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CARRIED = ("ray", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "jsonschema",
           "jsonschema-specifications", "referencing", "rpds-py", "trl")
"""What a node with the usual ML stack (torch, transformers, peft, numpy, scipy, PyYAML, rich, requests,
msgpack, protobuf, …) lacks for ``make gpu-check``: Ray and its schema checks, pydantic (the config), trl
(the preference tests). Measured on an H200 node's image (2026-11); another node may lack more."""

RAY_DROPPED = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/llm/", "ray/data/")
"""Parts of Ray's wheel a check never loads (with every ``*.js.map``): its Java jars, the dashboard's web
build, and the libraries of Ray's own a fedsweep run does not import (RLlib, Serve, LLM, Data: a local
runtime, placement groups and actors started with them blocked, 2026-12-07)."""

LIMIT_BYTES = 56 * 2 ** 20
"""What one call of the device tool may carry for the check, with room under its 64 MiB: the tree, the
wheels and the data (:func:`carried`). The bundle refuses to build above it."""
MEASURED_BYTES = {"wheels": 44448052, "data": 4_388_465}
"""The wheels (Python 3.12, Ray stripped as above) and ``.devdata/`` as built on 2026-12-07: what the
suite adds to the tree's size where the bundle is not built (``tests/test_gpu_check.py``)."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def download(names: tuple[str, ...], python_version: str, out: Path) -> list[Path]:
    """The wheels of ``names`` at the versions installed here, for CPython ``python_version``."""
    out.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={md.version(name)}" for name in names]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *platforms, "--platform", "any", "-d", str(out), *pins]
    subprocess.run(cmd, check=True)
    return sorted(out.glob("*.whl"))


def strip_wheel(path: Path, dropped: tuple[str, ...] = RAY_DROPPED) -> tuple[int, int]:
    """Rewrite the wheel at ``path`` without the members under ``dropped`` or ending in ``.js.map``;
    (bytes before, bytes after)."""
    before = path.stat().st_size
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.startswith(dropped) or item.filename.endswith(".js.map"):
                continue
            dst.writestr(item, src.read(item.filename))
    tmp.replace(path)
    return before, path.stat().st_size


def gpu_check_configs() -> list[list[str]]:
    """The ``--set`` overrides of every ``make gpu-check`` step that runs a fedsweep command on the demo."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    out = []
    for _, argv, _, _ in gpu_check.steps(False, ROOT / "results" / "gpu" / "plan", profile=True):
        if gpu_check.DEMO in argv and "--ideal-of" not in argv:  # (the ideal step reads the round step's JSON)
            out.append([argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
    return out


def prepare_data(cache: Path) -> int:
    """The records of every gpu-check config, generated into ``cache``; how many configs."""
    os.environ["FEDSWEEP_CACHE"] = str(cache)
    from fedsweep.config import load_config
    from fedsweep.orchestrator.experiment_data import prepare_data as prepare

    configs = gpu_check_configs()
    for overrides in configs:
        prepare(load_config(str(ROOT / "configs/experiments/demo.yaml"), overrides))
    return len(configs)


def stub_distribution(site: Path, name: str = "reasoning-gym") -> Path:
    """``site/<name>-<version>.dist-info`` with only its metadata: what ``importlib.metadata.version``
    reads, at the version installed here."""
    version = md.version(name)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return info


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_bytes(root: Path = ROOT) -> int:
    """The working tree the device tool carries: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / name.decode()).stat().st_size for name in listed if name and (root / name.decode()).is_file())


def carried(root: Path, wheels: Path, data: Path) -> dict[str, int]:
    """What one call carries: the tree, the wheels, the data (bytes)."""
    return {"tree": tree_bytes(root), "wheels": size(wheels) if wheels.is_dir() else 0,
            "data": size(data) if data.is_dir() else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python-version", default="3.12", help="the node's Python (default 3.12)")
    ap.add_argument("--wheels", default=".whl", help="folder for the wheels (default .whl)")
    ap.add_argument("--data", default=".devdata", help="folder for the data cache and the stub (default .devdata)")
    ap.add_argument("--no-download", action="store_true", help="the data and the stub only")
    args = ap.parse_args(argv)
    from fedsweep.data.bundled import cache_dir

    wheels, data = ROOT / args.wheels, ROOT / args.data
    here = cache_dir()  # this machine's cache, read before prepare_data points FEDSWEEP_CACHE at the bundle
    if not args.no_download:
        shutil.rmtree(wheels, ignore_errors=True)
        for path in download(CARRIED, args.python_version, wheels):
            if path.name.startswith("ray-"):
                before, after = strip_wheel(path)
                print(f"{path.name}: {before / 2 ** 20:.1f} → {after / 2 ** 20:.1f} MiB (jars, dashboard build, source maps dropped)")
        print(f"{wheels}: {len(list(wheels.glob('*.whl')))} wheels, {size(wheels) / 2 ** 20:.1f} MiB")
    n = prepare_data(data)
    copied = 0
    if here.is_dir() and here.resolve() != (data / "data").resolve():
        for path in here.glob("*.json"):
            if not (data / "data" / path.name).exists():
                shutil.copy2(path, data / "data" / path.name)
                copied += 1
    info = stub_distribution(data / "site")
    print(f"{data}: the records of {n} gpu-check configs and {copied} more from {here}, "
          f"stub {info.name}; {size(data) / 2 ** 20:.1f} MiB")
    parts = carried(ROOT, wheels, data)
    total = sum(parts.values())
    print("one call carries " + ", ".join(f"{k} {v / 2 ** 20:.1f}" for k, v in parts.items())
          + f" = {total / 2 ** 20:.1f} MiB (at most {LIMIT_BYTES / 2 ** 20:.0f})")
    if total > LIMIT_BYTES:
        shutil.rmtree(wheels, ignore_errors=True)
        print(f"refused: {total / 2 ** 20:.1f} MiB is over {LIMIT_BYTES / 2 ** 20:.0f} MiB; the wheels were removed "
              f"(carry less: fewer CARRIED packages, more of Ray dropped, or a smaller tree)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
