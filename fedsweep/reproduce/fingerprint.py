"""A card's numerics fingerprint: what its study's code computes, in a few seconds per arm, so that a report
is judged stale by what changed in its numbers rather than by which files moved.

Each arm (variant) of a card's cpu study runs one short trial — the card's study as ``fedsweep reproduce``
builds it (its experiment, its ``set``, the variant; seed :data:`SEED`), shortened by :data:`RECIPE` (2 rounds of
1 step on 24 examples a task, on the tiny Llama of the same family, randomly initialised from the seed) — and
one more trial runs the card's first arm on the card's own model (:data:`MODEL_RECIPE`: one round of one
step), so the bundled model's loading and its forward are covered too. Each trial's fingerprint is:

- every tensor of its final checkpoint (digest of dtype, shape and bytes, by file and name);
- every JSON file of that checkpoint, less the keys that hold wall-clock time (``bitwise.is_timing``);
- every client's metric values of the last round's record, less timings (seconds and shares of them,
  such as pFedGPT's ``hbo_share``) and the execution's own counts
  (:data:`EXECUTION_KEYS`: how clients were batched, not what they computed).

A report records the fingerprint of its card at the commit it ran at (``fingerprints.json.gz`` in the
card's folder, by commit; each arm :func:`compact`: its names as one digest, its digests as one string). ``fedsweep reproduce --list`` recomputes a card's fingerprint at HEAD only where
the file rule (:mod:`fedsweep.reproduce.numerics_paths`) says its code changed, and calls a report stale
only where a fingerprint differs, naming the arm and the tensors or values.

Like :mod:`fedsweep.reproduce.bitwise` (whose trial files and digests it uses), every trial runs through
``fedsweep run`` in a subprocess of the checkout this module lies in, and the module runs as a script in a
checkout of an older commit (``fedsweep reproduce CARD --fingerprint --at COMMIT`` copies it and this
checkout's cards there), so one procedure fingerprints both sides.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

RECIPE_VERSION = 1
"""A changed recipe is a new version: fingerprints of two versions are never compared."""
RECIPE = ("rounds=2", "eval_every=2", "train.steps=1", "data.examples_per_task=24", "model.name=tiny@64x2")
"""How every arm's trial is shortened (applied after the card's ``set`` and the variant)."""
MODEL_RECIPE = ("rounds=1", "eval_every=1", "train.steps=1", "data.examples_per_task=24")
"""The card's first arm on the card's own model (the bundled SmolLM2 on the cpu budget)."""
SEED = 0
"""Every fingerprint trial's seed, whatever seeds the card's version tests: the fingerprint is of the
code, and stays comparable across a card's versions."""
MODEL_ARM = "@model"
"""The suffix of the trial on the card's own model (``<first arm>@model``)."""
EXECUTION_KEYS = frozenset({"batched_clients", "train_padded_tokens"})
"""Record metrics that say how the work was laid out, not what it computed."""
SHORT = 12
"""Hex digits kept of each tensor's and JSON file's SHA-256 (48 bits: a changed tensor keeps its short digest
with odds of 1 in 3e14)."""
STORE = "fingerprints.json.gz"
"""In ``reproductions/CARD/``: the card's fingerprints, by commit. A record, not code: a checkout where only
these changed records its commit clean (``provenance.FINGERPRINT_STORE``, the same name, tested; not
imported, since this module also runs as a script in older checkouts)."""


def _bitwise():
    if str(ROOT) not in sys.path:  # (called per trial, record and comparison: the path once)
        sys.path.insert(0, str(ROOT))
    from fedsweep.reproduce import bitwise

    return bitwise


def trials(cards: list[str] | None, arms: list[str] | None = None
           ) -> list[tuple[str, str, list[str], dict, Path, int, str]]:
    """(card, arm, recipe, study, experiment, seed, variant) of each fingerprint trial; ``arms``: only these
    (a variant's name, or ``NAME@model``)."""
    out, first = [], {}
    for card, variant, study, experiment, seed in _bitwise().trials(cards, None, SEED):
        out.append((card, variant, list(RECIPE), study, experiment, seed, variant))
        first.setdefault(card, (study, experiment, seed, variant))
    for card, (study, experiment, seed, variant) in first.items():
        out.append((card, variant + MODEL_ARM, list(MODEL_RECIPE), study, experiment, seed, variant))
    return [t for t in out if arms is None or t[1] in arms]


def _short(hexdigest: str) -> str:
    return hexdigest[:SHORT]


def record_metrics(checkpoints: Path) -> dict[str, dict[str, float]]:
    """Every client's metric values in the last round's record (timings — seconds and shares of them,
    ``bitwise.is_timing`` — and execution counts left out)."""
    records = sorted((checkpoints / "records").glob("round_*.json"))
    if not records:
        return {}
    raw = json.loads(records[-1].read_text()).get("client_metrics", {})
    timing = _bitwise().is_timing
    return {str(cid): {k: v for k, v in sorted(values.items()) if not timing(k) and k not in EXECUTION_KEYS}
            for cid, values in sorted(raw.items(), key=lambda kv: str(kv[0]))}


def trial_print(checkpoints: Path) -> dict:
    """One finished trial's fingerprint (see the module's docstring)."""
    bitwise = _bitwise()
    rounds = sorted(p for p in checkpoints.glob("round_*") if p.is_dir())
    full = bitwise.digests(rounds[-1])
    decided = {k: v for k, v in full.items() if not k.endswith(":timings")}
    return {"round": rounds[-1].name, "digests": {k: _short(v) for k, v in sorted(decided.items())},
            "metrics": record_metrics(checkpoints)}


def run_trial(card: str, arm: str, recipe: list[str], study: dict, experiment: Path, seed: int,
              variant: str) -> dict:
    """Run one fingerprint trial (``fedsweep run`` in a subprocess of this checkout) and fingerprint it."""
    import yaml

    bitwise = _bitwise()
    from fedsweep.config.loading import apply_override

    with tempfile.TemporaryDirectory(prefix=f"fingerprint-{card}-") as tmp:
        work = Path(tmp)
        path = bitwise.trial_file(study, experiment, variant, seed, work)
        raw = yaml.safe_load(path.read_text())
        for item in recipe:
            apply_override(raw, item)
        raw["name"] = f"fingerprint-{arm.replace('@', '-')}"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        t0 = time.perf_counter()
        proc = subprocess.run([*bitwise.command_line(), "run", str(path)], cwd=ROOT, capture_output=True, text=True)
        seconds = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0:
            return {"error": ((proc.stderr or proc.stdout).strip().splitlines() or ["?"])[-1], "seconds": seconds}
        folders = sorted((work / "runs").glob("*/*/checkpoints"))
        if not folders or not list(folders[-1].glob("round_*")):
            return {"error": "no checkpoint written", "seconds": seconds}
        return {**trial_print(folders[-1]), "seconds": seconds}


def commit_of(root: Path = ROOT) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()


def collect(cards: list[str] | None, say=print, arms: list[str] | None = None) -> dict[str, dict]:
    """Every chosen card's fingerprint at this checkout: ``{card: {"commit", "recipe", "arms": {arm: …}}}``."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    commit, out = commit_of(), {}
    for card, arm, recipe, study, experiment, seed, variant in trials(cards, arms):
        one = run_trial(card, arm, recipe, study, experiment, seed, variant)
        entry = out.setdefault(card, {"commit": commit, "recipe": RECIPE_VERSION, "arms": {}})
        entry["arms"][arm] = one
        say(f"{card}/{arm}: {one['seconds']} s" + (f", FAILED: {one['error']}" if "error" in one else ""))
    return out


# ------------------------------------------------------------------------------------ comparing


def differences(then: dict, now: dict, limit: int = 4) -> list[str]:
    """What differs between a card's fingerprint at a report's commit (``then``) and now, arm by arm: the
    tensors and JSON files (any one present on one side only, or with another digest), the metric values
    both sides record (both numbers; a metric one side does not record is no difference: a new metric
    moves no tested value; a timing, :func:`bitwise.is_timing`, is never compared); [] where nothing does."""
    timing = _bitwise().is_timing  # (a store recorded before a timing was known as one: never compared)
    if then.get("recipe") != now.get("recipe"):
        return [f"fingerprint recipe {then.get('recipe')} against {now.get('recipe')}: not comparable"]
    out = []
    for arm in sorted(set(then["arms"]) | set(now["arms"])):
        a, b = then["arms"].get(arm), now["arms"].get(arm)
        if a is None or b is None:
            out.append(f"{arm}: only {'now' if a is None else 'then'}")
            continue
        if "error" in a or "error" in b:
            out.append(f"{arm}: failed {'then' if 'error' in a else 'now'} ({(a if 'error' in a else b)['error']})")
            continue
        keys = _differing(a, b)
        values = [f"client {c} {k} {a['metrics'][c][k]!r} → {b['metrics'][c][k]!r}"
                  for c in sorted(set(a["metrics"]) & set(b["metrics"]))
                  for k in sorted(set(a["metrics"][c]) & set(b["metrics"][c]))
                  if a["metrics"][c][k] != b["metrics"][c][k] and not timing(k)]
        if set(a["metrics"]) != set(b["metrics"]):
            values.append(f"clients {sorted(a['metrics'])} → {sorted(b['metrics'])}")
        if not keys and not values:
            continue
        what = [*values[:limit], *keys[:limit]]
        more = len(values) + len(keys) - len(what)
        out.append(f"{arm}: {len(keys)} tensors or files and {len(values)} values differ "
                   f"({'; '.join(what)}{f'; {more} more' if more > 0 else ''})")
    return out


def compact(arm: dict) -> dict:
    """An arm's fingerprint as the store keeps it: its tensor and file names as one digest (``names``) and
    their digests as one string in the names' sorted order (``tensors``), instead of a name → digest map
    (the names are most of its bytes, and HEAD's side, computed in full, names what differs)."""
    if "digests" not in arm:
        return arm
    names = sorted(arm["digests"])
    return {**{k: v for k, v in arm.items() if k not in ("digests", "seconds")},
            "names": hashlib.sha256("\n".join(names).encode()).hexdigest()[:SHORT],
            "tensors": "".join(arm["digests"][n] for n in names)}


def _differing(a: dict, b: dict) -> list[str]:
    """The tensors and JSON files whose digests differ between two arms (full or :func:`compact`), named
    where one side is full."""
    if "digests" in a and "digests" in b:
        return sorted(k for k in set(a["digests"]) | set(b["digests"]) if a["digests"].get(k) != b["digests"].get(k))
    ca, cb = compact(a), compact(b)
    if ca["names"] != cb["names"]:
        full = a if "digests" in a else b if "digests" in b else None
        return [f"the tensor and file names ({len(full['digests']) if full else '?'} on one side) are not the same"]
    names = sorted((a if "digests" in a else b).get("digests", {})) or None
    chunks = [(ca["tensors"][i:i + SHORT], cb["tensors"][i:i + SHORT]) for i in range(0, len(ca["tensors"]), SHORT)]
    return [names[i] if names else f"#{i}" for i, (x, y) in enumerate(chunks) if x != y]


class Judge:
    """``judge(card, commit)``: the differences between the card's fingerprint recorded at ``commit`` and
    HEAD's (:func:`differences`; None where none was recorded). HEAD's is computed once per card and kept
    in a cache folder by a digest of everything it runs (the package, the cards, the recipe), so a second
    ``--list`` on the same code runs nothing."""

    def __init__(self, root: Path = ROOT, say=print, cache: Path | None = None):
        self.root, self.say = Path(root), say
        self.cache = Path(cache or os.environ.get("FEDSWEEP_FINGERPRINT_CACHE")
                          or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedsweep" / "fingerprints")
        self._head: dict[str, dict] = {}
        self.computed: list[str] = []
        """The cards whose HEAD fingerprint this judge ran (not read from the cache)."""

    def __call__(self, card: str, commit: str) -> list[str] | None:
        then = stored(card, self.root).get(commit)
        return None if then is None else differences(then, self.head(card))

    def key(self, card: str) -> str:
        """A digest of what a card's HEAD fingerprint runs: every file of the package and the cards."""
        h = hashlib.sha256(json.dumps([card, RECIPE_VERSION, RECIPE, MODEL_RECIPE]).encode())
        for folder in ("fedsweep", "configs/reproductions"):
            for path in sorted((self.root / folder).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".c", ".h", ".yaml"):
                    h.update(path.relative_to(self.root).as_posix().encode() + b"\0" + path.read_bytes())
        return h.hexdigest()[:24]

    def head(self, card: str) -> dict:
        if card not in self._head:
            path = self.cache / f"{card}-{self.key(card)}.json"
            if path.is_file():
                self._head[card] = json.loads(path.read_text())
            else:
                self.say(f"{card}: its fingerprint at HEAD (a short trial per arm)")
                self._head[card] = collect([card], say=self.say)[card]
                self.computed.append(card)
                self.cache.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(self._head[card]))
        return self._head[card]


# ------------------------------------------------------------------------------------ the store


def store_path(card: str, root: Path = ROOT) -> Path:
    return root / "reproductions" / card / STORE


def stored(card: str, root: Path = ROOT) -> dict[str, dict]:
    """The card's recorded fingerprints, by commit ({} where none)."""
    path = store_path(card, root)
    return json.loads(gzip.decompress(path.read_bytes())) if path.is_file() else {}


def store(card: str, fingerprint: dict, root: Path = ROOT) -> Path:
    """Record ``fingerprint`` (of one card, at its commit) beside the card's reports (seconds left out:
    the file changes only with the numbers)."""
    entry = {**fingerprint, "arms": {arm: compact(one) for arm, one in fingerprint["arms"].items()}}
    everything = {**stored(card, root), fingerprint["commit"]: entry}
    path = store_path(card, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(everything, sort_keys=True, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(text, mtime=0))
    return path


def at_commit(commit: str, cards: list[str], say=print) -> dict[str, dict]:
    """The cards' fingerprints at ``commit``: a temporary worktree of it, this module, its sibling
    ``bitwise.py`` and this checkout's cards copied in, the module run there as a script."""
    import shutil

    with tempfile.TemporaryDirectory(prefix="fingerprint-at-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for name in ("fingerprint.py", "bitwise.py"):
                (tree / "fedsweep" / "reproduce").mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(__file__).with_name(name), tree / "fedsweep" / "reproduce" / name)
            shutil.rmtree(tree / "configs" / "reproductions", ignore_errors=True)
            shutil.copytree(ROOT / "configs" / "reproductions", tree / "configs" / "reproductions")
            out = Path(tmp) / "out.json"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            proc = subprocess.Popen([sys.executable, str(tree / "fedsweep" / "reproduce" / "fingerprint.py"),
                                     "--cards", *cards, "--out", str(out)], cwd=tree, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                say(line.rstrip())
            if proc.wait() != 0 or not out.is_file():
                raise RuntimeError(f"the fingerprint at {commit[:12]} failed (exit {proc.returncode})")
            result = json.loads(out.read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for entry in result.values():
        entry["commit"] = full or commit
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cards", nargs="*")
    p.add_argument("--arms", nargs="*", help="only these arms (a variant, or VARIANT@model)")
    p.add_argument("--out", required=True, help="write the fingerprints here (JSON)")
    args = p.parse_args(argv)
    result = collect(args.cards, say=lambda line: print(line, flush=True), arms=args.arms)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
