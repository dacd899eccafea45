"""The experiment's worker set-up hook (not part of fedsweep): every Ray worker imports what a client
actor imports before Ray hands it a task, and notes when it started and finished."""
import os
import time


def preload():
    started = time.time()
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import peft  # noqa: F401
    import fedsweep.actors.client  # noqa: F401
    out = os.environ.get("PRELOAD_LOG")
    if out:
        with open(os.path.join(out, f"preload-{os.getpid()}.txt"), "w") as f:
            f.write(f"{started} {time.time()}\n")
