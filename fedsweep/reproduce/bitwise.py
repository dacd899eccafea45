"""``fedsweep reproduce [CARD|all] --bitwise``: one trial of each variant of every reproduction card's cpu
study, run to its end, and the digest of every tensor and JSON file of its final checkpoint — the
check that a change leaves the numbers alone::

    fedsweep reproduce --bitwise --out BEFORE.json            # at the commit before the change
    fedsweep reproduce --bitwise --out AFTER.json             # after it
    fedsweep reproduce --bitwise --compare BEFORE.json AFTER.json

Each trial is the card's study as ``fedsweep reproduce`` builds it (its experiment, the variant's
overrides, the first seed), run with ``fedsweep run`` (the command line only, so that the same module
drives any commit: ``python fedsweep/reproduce/bitwise.py`` runs it as a script in a checkout of an
older commit, which then imports that checkout's fedsweep) with tracking off and its checkpoints in a
folder of its own. A tensor is compared by name, dtype, shape and bytes; a JSON file by its parsed
content less the keys that hold wall-clock time (their names have ``seconds``, or a share of time such as
pFedGPT's ``hbo_share``: listed, never compared). ``CARD`` and ``--variants`` choose a subset; ``--seed`` another seed.
Standard library, yaml, safetensors and torch only, and from fedsweep only what every commit since
2026-11-22 has (``fedsweep.config.loading``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
"""The checkout this module lies in (its fedsweep is the one the trials run)."""
CARDS = ROOT / "configs" / "reproductions"


def trials(cards: list[str] | None, variants: list[str] | None, seed: int | None):
    """(card, variant, sweep file data) of each trial to run."""
    for path in sorted(CARDS.glob("*.yaml")):
        card = yaml.safe_load(path.read_text())
        if cards and card["card"] not in cards:
            continue
        study = dict(card["budgets"]["cpu"]["study"])
        experiment = (path.parent / study["experiment"]).resolve()
        for variant in study.get("variants") or {"_": {}}:
            if variants and variant not in variants:
                continue
            yield card["card"], variant, study, experiment, seed if seed is not None else study.get("seeds", [0])[0]


def trial_file(study: dict, experiment: Path, variant: str, seed: int, work: Path) -> Path:
    """The trial's experiment as a file (the sweep's base, its ``set``, the variant, the seed)."""
    from fedsweep.config.loading import apply_override, read_yaml

    raw = read_yaml(experiment, "experiment file", "an experiment file")
    for item in study.get("set") or []:
        apply_override(raw, item)
    for key, value in ((study.get("variants") or {}).get(variant) or {}).items():
        apply_override(raw, f"{key}={json.dumps(value)}")
    raw["seed"] = seed
    raw["name"] = f"bitwise-{variant}"
    raw.setdefault("checkpoint", {})["dir"] = str(work / "runs")
    raw["checkpoint"]["keep"] = 1
    raw.setdefault("tracking", {})["enabled"] = False
    path = work / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def digests(folder: Path) -> dict[str, str]:
    """Every tensor (``file:name``) and JSON file of a checkpoint round, by SHA-256."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.iterdir()):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as handle:
                for name in handle.keys():
                    t = handle.get_tensor(name).contiguous()
                    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
                    h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b"")
                    out[f"{f.name}:{name}"] = h.hexdigest()
        elif f.suffix == ".json" and f.name != "MANIFEST.json":
            content, timings = without_timings(json.loads(f.read_text()))
            out[f.name] = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
            if timings:  # wall-clock seconds differ between any two runs: listed, never compared
                out[f"{f.name}:timings"] = "not compared: " + ", ".join(sorted(timings))
    return out


TIME_SHARES = frozenset({"hbo_share", "hbo_share_run"})
"""Metrics that are shares of wall-clock time (pFedGPT's HBO over a client's or the run's time): as
variable between two runs of the same numbers as the seconds they divide."""


def is_timing(key) -> bool:
    """Whether ``key`` holds wall-clock time: its name has ``seconds``, or it is one of :data:`TIME_SHARES`."""
    return "seconds" in str(key) or str(key) in TIME_SHARES


def without_timings(value, path: str = "") -> tuple[object, set[str]]:
    """``value`` less every key that holds wall-clock time (:func:`is_timing`), and their paths."""
    if isinstance(value, dict):
        kept, dropped = {}, set()
        for key, item in value.items():
            if is_timing(key):
                dropped.add(f"{path}{key}")
                continue
            kept[key], inner = without_timings(item, f"{path}{key}.")
            dropped |= inner
        return kept, dropped
    if isinstance(value, list):
        items = [without_timings(item, path) for item in value]
        return [i for i, _ in items], set().union(*(d for _, d in items)) if items else set()
    return value, set()


def command_line() -> list[str]:
    """``python -m`` the ``fedsweep`` command of the checkout this script lies in (the package moved
    from ``fedsweep.orchestrator.cli`` to ``fedsweep.cli`` on 2026-11-28)."""
    module = "fedsweep.cli" if (ROOT / "fedsweep" / "cli" / "__init__.py").is_file() else "fedsweep.orchestrator.cli"
    return [sys.executable, "-m", module]


def run_one(card: str, variant: str, study: dict, experiment: Path, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bitwise-{card}-") as tmp:
        work = Path(tmp)
        path = trial_file(study, experiment, variant, seed, work)
        t0 = time.perf_counter()
        proc = subprocess.run([*command_line(), "run", str(path)], cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:], "seconds": seconds}
        rounds = sorted((work / "runs").glob("*/*/checkpoints/round_*"))
        return {"seconds": round(seconds, 1), "round": rounds[-1].name, "digests": digests(rounds[-1])}


def compare(before: dict, after: dict, say=print) -> int:
    """Each trial of both results bitwise equal, differing (the first few tensors or files named) or
    missing; 1 where any is not equal."""
    bad = 0
    for key in sorted(set(before["trials"]) | set(after["trials"])):
        a, b = before["trials"].get(key), after["trials"].get(key)
        if a is None or b is None:
            say(f"{key}: only in {'after' if a is None else 'before'}")
            bad += 1
            continue
        if "digests" not in a or "digests" not in b:
            say(f"{key}: failed ({a.get('error') or b.get('error')})")
            bad += 1
            continue
        differ = sorted(k for k in set(a["digests"]) | set(b["digests"])
                        if a["digests"].get(k) != b["digests"].get(k) and not k.endswith(":timings"))
        say(f"{key}: {'bitwise equal' if not differ else 'DIFFERS'} ({len(a['digests'])} tensors and files"
              f"{'; ' + ', '.join(differ[:5]) if differ else ''})")
        bad += bool(differ)
    say(f"{len(set(before['trials']) | set(after['trials'])) - bad} equal, {bad} differ or failed "
          f"({before.get('commit', '?')[:10]} against {after.get('commit', '?')[:10]})")
    return 1 if bad else 0


def collect(cards: list[str] | None, variants: list[str] | None, seed: int | None, out: str | None,
            say=print) -> dict:
    """Run every chosen trial (``fedsweep run`` in a subprocess of this checkout) and collect its digests;
    written to ``out`` after each trial where given."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "trials": {}}
    for card, variant, study, experiment, s in trials(cards, variants, seed):
        one = run_one(card, variant, study, experiment, s)
        result["trials"][f"{card}/{variant}/seed{s}"] = one
        say(f"{card}/{variant} seed {s}: {one.get('seconds')} s, {len(one.get('digests', {})) or one.get('error')}")
        if out:
            Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the digests here (JSON)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--cards", nargs="*")
    p.add_argument("--variants", nargs="*")
    p.add_argument("--seed", type=int)
    args = p.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(Path(f).read_text()) for f in args.compare))
    sys.path.insert(0, str(ROOT))  # run as a script: this checkout's fedsweep, whichever one is installed
    collect(args.cards, args.variants, args.seed, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
