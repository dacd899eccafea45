"""When a process started, in epoch seconds, to the clock tick (10 ms).

``psutil.Process().create_time()`` adds the process's start (clock ticks after boot) to a boot time it
reads from ``/proc/stat``, which holds whole seconds: its answer is off by up to a second, the same
offset for every process until the machine reboots (which made every ``fedsweep bench run`` total
that much too long). Here the boot time is ``now - /proc/uptime``
(hundredths of a second) instead. Elsewhere than Linux, psutil's answer.
"""

from __future__ import annotations

import os
import time


def process_start_epoch(pid: int | None = None) -> float:
    """Epoch seconds at which process ``pid`` (this one by default) started."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; fields 3.. follow the name
        return now - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process(pid).create_time()
