"""``python -m fedsweep.orchestrator.runtime.watchdog DRIVER_PID PID…``: when the driver process is gone,
end the given processes and all their descendants (SIGTERM, then SIGKILL after 3 s); exit as
soon as they are all gone on their own (a normal ``ray.shutdown``)."""

from __future__ import annotations

import sys
import time


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process descending from them, from one scan of the process table."""
    import psutil

    children: dict[int, list[int]] = {}
    for p in psutil.process_iter(["pid", "ppid"]):
        children.setdefault(p.info["ppid"], []).append(p.info["pid"])
    out, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid not in out:
            out.add(pid)
            stack.extend(children.get(pid, []))
    return out


def main(argv: list[str]) -> int:
    import psutil

    driver, roots = int(argv[0]), {int(p) for p in argv[1:]}
    try:
        driver_proc = psutil.Process(driver)
        started = driver_proc.create_time()
    except psutil.Error:
        driver_proc, started = None, None
    known: dict[int, psutil.Process] = {}
    while True:
        # remember every descendant while its parent lives: once the raylet dies its agents are
        # re-parented to init and could no longer be found from it
        for pid in descendants(roots | set(known)) - set(known):
            try:
                known[pid] = psutil.Process(pid)
            except psutil.Error:
                pass
        try:
            alive = driver_proc is not None and driver_proc.is_running() and driver_proc.create_time() == started \
                and driver_proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not any(p.is_running() for p in known.values()):
            return 0  # the runtime is gone: nothing to watch
        if not alive:
            break
        time.sleep(0.5)
    procs = [p for p in known.values() if p.is_running()]
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=3)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
