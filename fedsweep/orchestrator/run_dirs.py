"""Where a run keeps its files: ``checkpoint.dir/<name>/<timestamp>/`` with run.json, config.yaml and
checkpoints/, and which config changes a resumption accepts."""

from __future__ import annotations

import time
from typing import Any

from fedsweep.config import ExperimentConfig
from fedsweep.errors import RunError
from fedsweep.storage import AnyPath, location

# keys that may differ between a run and its resumption
RESUMABLE_CHANGES = ("rounds", "eval_every", "tracking", "server.call_timeout_s", "eval", "checkpoint.keep",
                     # where the run's folder lives: it was found there, so a moved or copied folder resumes
                     "checkpoint.dir",
                     # where clients run, not what they compute: a run may resume on another layout or cluster
                     "clients.shard", "clients.resources", "clients.clients_per_actor", "clients.num_actors",
                     "clients.placement_strategy", "clients.park")


def checkpoint_base(cfg: ExperimentConfig) -> AnyPath:
    """``checkpoint.dir/name``: a local folder (made absolute) or a pyarrow URI (shared storage)."""
    return location(cfg.checkpoint.dir).resolve() / cfg.name


def new_run_dir(cfg: ExperimentConfig) -> AnyPath:
    base = checkpoint_base(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, i = base / stamp, 1
    while path.exists():
        path, i = base / f"{stamp}-{i}", i + 1
    path.mkdir(parents=True)
    return path


def latest_run_dir(cfg: ExperimentConfig) -> AnyPath:
    base = checkpoint_base(cfg)
    runs = sorted(p for p in base.glob("*") if (p / "run.json").exists()) if base.is_dir() else []
    if not runs:
        raise RunError(f"--resume: no earlier run of '{cfg.name}' under {base}")
    return runs[-1]


def config_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first difference between two resolved configs outside :data:`RESUMABLE_CHANGES`, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if any(sub == k or sub.startswith(k + ".") for k in RESUMABLE_CHANGES):
                continue
            found = config_difference(a.get(key), b.get(key), sub)
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} in the run, {b!r} now"
