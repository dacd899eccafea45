"""The machine a result was computed on: what a reader needs when the same code and packages give other
values elsewhere.

Float sums depend on the kernels torch picks, and those depend on the CPU (its instruction sets) and
on the number of threads. FedReFT+'s card showed it: the code of one commit, with the same package
versions, gave one run's FedAvg test loss as 3.178 on one day and 2.746 on the next on the project's
VM; its validation-loss grid for α turned a float-level difference into another choice. Reports and
benchmark JSONs therefore carry this record beside the commit.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel reports it (``platform.processor()`` where there is no
    ``/proc/cpuinfo``, ``unknown`` where neither says)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """The CPU's model, the logical CPUs this process may use, torch's CPU kernel level (``AVX2``,
    ``AVX512``, …) and the GPU's name (None without one; both ``unknown`` without torch). Threads are
    not recorded: a run's actors set their own, which the process writing the record does not see."""
    out: dict[str, Any] = {"cpu": cpu_model(), "platform": platform.platform(),
                           "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else os.cpu_count()}
    try:
        import torch

        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 (a record of the machine never stops the report)
        out["torch_cpu_capability"] = out["gpu"] = "unknown"
    return out
