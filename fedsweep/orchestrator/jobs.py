"""``fedsweep submit`` / ``fedsweep jobs``: run an experiment or a study as a Ray job on a cluster.

The file is validated here first (a bad config fails in one line before anything is sent).
The job's entrypoint is ``<python> -m fedsweep.cli run|tune FILE [--set ...]``,
shipped with a runtime environment: the working directory (this repository, without
``.venv``, ``results`` and ``.git``), pinned pip requirements or a prebuilt image, and
environment variables. Tracking goes to a configurable MLflow URI (a shared server on the
cluster: ``--set tracking.uri=http://mlflow:5000``) and checkpoints to shared storage
(``--set checkpoint.dir=/mnt/shared/runs``).

Authentication: Ray 2.60 clusters run with token authentication by default. Export
``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` (or keep Ray's token file): the Jobs SDK
sends the token as a header. fedsweep never writes the token into a config, a runtime
environment or a log; ``env`` entries named like a secret are refused.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path
from typing import Any, Callable

from fedsweep.config import ConfigError, read_yaml
from fedsweep.env import worker_env

EXCLUDES = [".venv/", "results/", ".git/", "**/__pycache__/", "*.egg-info/", ".whl/"]
SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|KEY)$", re.IGNORECASE)


def kind_of(path: str) -> str:
    """``tune`` for a sweep file (it names an ``experiment``), else ``run``."""
    raw = read_yaml(Path(path))
    return "tune" if isinstance(raw, dict) and "experiment" in raw else "run"


def check(path: str, overrides: list[str]) -> str:
    """Validate locally; return the fedsweep command the job runs."""
    kind = kind_of(path)
    if kind == "tune":
        from fedsweep.config.sweep import load_sweep

        load_sweep(path, overrides)
    else:
        from fedsweep.config import load_config

        load_config(path, overrides)
    return kind


def runtime_env(working_dir: str | None, requirements: str | None, pip: list[str] | None, image: str | None,
                env: dict[str, str]) -> dict[str, Any]:
    bad = [k for k in env if SECRET.search(k)]
    if bad:
        raise ConfigError(f"--env {bad[0]}: secrets do not travel in a runtime environment; set them on the cluster")
    out: dict[str, Any] = {"env_vars": worker_env(**env)}
    if working_dir:
        out["working_dir"] = working_dir
        out["excludes"] = EXCLUDES
    if requirements:
        req = Path(requirements)
        if not req.is_file():
            raise ConfigError(f"--requirements {requirements}: file not found")
        out["pip"] = [line.strip() for line in req.read_text().splitlines() if line.strip() and not line.startswith("#")]
    elif pip:
        out["pip"] = pip
    if image:
        out["image_uri"] = image
    return out


def entrypoint(python: str, kind: str, path: str, overrides: list[str]) -> str:
    parts = [python, "-m", "fedsweep.cli", kind, path, *(a for s in overrides for a in ("--set", s))]
    if kind == "run":
        parts.append("--quiet")
    return " ".join(shlex.quote(p) for p in parts)


def client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # connection refused, auth rejected, …
        raise ConfigError(f"--address {address}: cannot reach the Ray Jobs API: {str(exc).splitlines()[0]}") from None


def submit(path: str, address: str, overrides: list[str], python: str = "python", working_dir: str | None = ".",
           requirements: str | None = None, pip: list[str] | None = None, image: str | None = None,
           env: dict[str, str] | None = None, entrypoint_resources: dict[str, float] | None = None,
           retry_s: float = 60.0) -> str:
    """Submit; returns the job id. Retries while the cluster's job agent is still starting."""
    import time

    kind = check(path, overrides)
    renv = runtime_env(working_dir, requirements, pip, image, env or {})
    jobs = client(address)
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return jobs.submit_job(entrypoint=entrypoint(python, kind, path, overrides), runtime_env=renv,
                                   metadata={"fedsweep": f"{kind} {path}"},
                                   entrypoint_resources=entrypoint_resources or None)
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise ConfigError(f"submission refused: {str(exc).splitlines()[0]}") from None
            time.sleep(1.0)


def follow(address: str, job_id: str, write: Callable[[str], None]) -> str:
    """Stream the job's logs until it ends; returns its final status."""
    jobs = client(address)

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            write(chunk)

    asyncio.run(tail())
    return str(jobs.get_job_status(job_id))


def status(address: str, job_id: str) -> dict[str, Any]:
    info = client(address).get_job_info(job_id)
    return {"job_id": job_id, "status": str(info.status), "message": info.message, "entrypoint": info.entrypoint,
            "start_time": info.start_time, "end_time": info.end_time}


def logs(address: str, job_id: str) -> str:
    return client(address).get_job_logs(job_id)


def stop(address: str, job_id: str) -> bool:
    return client(address).stop_job(job_id)
