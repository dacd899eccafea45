"""Where a run keeps its files: ``checkpoint.dir/<name>/<timestamp>/`` with run.json, config.yaml and
checkpoints/, and which config changes a resumption accepts.

``run.json`` is the run's identity, written whole (``storage.write_atomic``) each time it changes: the
resolved config, the MLflow run's id from the moment the run exists, the driver that holds the run (its
host, pid and start: a *lease*) and, once the driver let go, how the run ended. A run whose driver is
gone without ending it (killed) is found by the next command that opens its folder and marked KILLED
in MLflow (:func:`abandoned`), unless it is resumed."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from fedsweep.config import ExperimentConfig
from fedsweep.errors import ConfigError, RunError
from fedsweep.storage import AnyPath, location, named_below, private_dir, redacted, write_atomic

# keys that may differ between a run and its resumption (not the tracking store: the run lives in it)
RESUMABLE_CHANGES = ("rounds", "eval_every", "tracking.wait_s", "tracking.enabled", "server.call_timeout_s", "eval",
                     "checkpoint.keep",
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
    return private_dir(path)


def latest_run_dir(cfg: ExperimentConfig) -> AnyPath:
    base = checkpoint_base(cfg)
    runs = sorted(p for p in base.glob("*") if (p / "run.json").exists()) if base.is_dir() else []
    if not runs:
        raise RunError(f"--resume: no earlier run of '{cfg.name}' under {base}")
    return runs[-1]


def config_difference(a: Any, b: Any, path: str = "", resumable: tuple[str, ...] = RESUMABLE_CHANGES) -> str | None:
    """The first difference between two resolved configs outside ``resumable`` (a run's
    :data:`RESUMABLE_CHANGES` unless told), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if any(sub == k or sub.startswith(k + ".") for k in resumable):
                continue
            found = config_difference(a.get(key), b.get(key), sub, resumable)
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} in the run, {b!r} now"


def resumable_run(cfg: ExperimentConfig) -> tuple[AnyPath, dict[str, Any]]:
    """The run ``--resume`` continues (the latest of this config) and its ``run.json``, or a
    error naming why not: checkpoints off (a resume would start again at round 1 in the same tracking
    run), no earlier run (:class:`RunError`), or a change outside :data:`RESUMABLE_CHANGES` (the field named).
    Called before Ray starts (``preflight.load_experiment``) and again by the run itself."""
    if not cfg.checkpoint.enabled:
        raise ConfigError("--resume needs checkpoint.enabled: true (without checkpoints a resumed run would "
                          "train again from round 1 and log every round twice)")
    run_dir = latest_run_dir(cfg)
    info = read_run_info(run_dir)
    diff = config_difference(info["config"], redacted(cfg.to_dict()))  # (run.json keeps no credentials)
    if diff:
        raise ConfigError(f"--resume: the config differs from the run in {run_dir}: {diff}")
    return run_dir, info


RUN_INFO = "run.json"


def write_run_info(run_dir: AnyPath, info: dict[str, Any]) -> None:
    """The run's ``run.json``, written whole."""
    write_atomic(run_dir / RUN_INFO, json.dumps(info, indent=1).encode())


def read_run_info(run_dir: AnyPath) -> dict[str, Any]:
    return json.loads((run_dir / RUN_INFO).read_text())


def lease() -> dict[str, Any]:
    """This driver, as ``run.json`` names the process that holds a run."""
    from fedsweep.process_start import process_start_epoch

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": round(process_start_epoch(), 2)}


def holder_alive(held: dict[str, Any] | None) -> bool | None:
    """Whether the driver a lease names still runs: None where it cannot be told (another host)."""
    if not held:
        return False
    if held.get("host") != socket.gethostname():
        return None
    from fedsweep.process_start import process_start_epoch

    try:
        return abs(process_start_epoch(int(held["pid"])) - float(held["started"])) < 1.0
    except (OSError, ValueError, KeyError, TypeError, ProcessLookupError):
        return False
    except Exception:  # (psutil's NoSuchProcess and the like)
        return False


def abandoned(root: AnyPath, mark, keep: AnyPath | None = None) -> list[AnyPath]:
    """Run folders below ``root`` whose driver is gone without ending the run (this host's drivers only;
    ``keep``: the folder about to be resumed): each handed to ``mark(run_id, info)`` (which ends its MLflow
    run KILLED where it is still RUNNING) and, unless that raised (the store away: tried again next time),
    marked ended ``KILLED`` in its ``run.json``. Returns the folders."""
    from pathlib import Path

    out = []
    if not isinstance(root, Path) or not root.is_dir():
        return out
    for path in named_below(root, RUN_INFO):  # (other runs' rounds commit under the walk)
        if keep is not None and path.parent == keep:
            continue
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if info.get("ended") or "driver" not in info or holder_alive(info.get("driver")) is not False:
            continue
        if info.get("run_id"):
            try:
                mark(info["run_id"], info)
            except Exception:  # noqa: BLE001  (the store does not answer now: the next command tries again)
                continue
        info["ended"] = "KILLED"
        write_run_info(path.parent, info)
        out.append(path.parent)
    return out
