"""Variant C's worker set-up hook (not part of fedsweep): every Ray worker imports torch (which the
server and every client actor import) before Ray hands it a task, and notes when it started and finished."""
import os
import time


def preload():
    started = time.time()
    import torch  # noqa: F401
    out = os.environ.get("PRELOAD_LOG")
    if out:
        with open(os.path.join(out, f"preload-{os.getpid()}.txt"), "w") as f:
            f.write(f"{started} {time.time()}\n")
