"""The set-up experiments' probes (not part of fedsweep), merged after the runs from the scripts they ran
as (preload_hook.py, torch_hook.py, raylet_gap.py, ray_start.py: same code).

Worker set-up hooks, run by Ray in every worker before its task loop when named in
``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR`` (``PYTHONPATH`` holding this folder); each notes its start and
end in ``$PRELOAD_LOG`` where that is set:

- ``probes.preload_actor_imports``: what a client actor imports before it builds a model;
- ``probes.preload_torch``: torch alone (the server and every client actor import it).

From the command line:

- ``python probes.py gap LABEL``: the newest Ray session's raylet wait between its object store's start
  and its object manager's (1.0 where its first connection to the store's socket waited for Ray's retry);
- ``python probes.py ray-start``: one local runtime started as a run starts it, timed, with that wait,
  as JSON; then stopped. Its clock starts before fedsweep's bench API is imported, which brings the
  runner: ray_start.py, which made results.json's figures, imported only the runtime's module, so
  these seconds run longer than those.
"""
import glob
import importlib
import json
import os
import re
import sys
import time
from datetime import datetime

ACTOR_IMPORTS = ("torch", "transformers.models.llama.modeling_llama", "peft", "fedsweep.actors.client")


def _preload(modules) -> None:
    started = time.time()
    for name in modules:  # by name, as Ray's own worker preloading does
        importlib.import_module(name)
    out = os.environ.get("PRELOAD_LOG")
    if out:
        with open(os.path.join(out, f"preload-{os.getpid()}.txt"), "w") as f:
            f.write(f"{started} {time.time()}\n")


def preload_actor_imports() -> None:
    _preload(ACTOR_IMPORTS)


def preload_torch() -> None:
    _preload(("torch",))


def _store_gap(session: str) -> float:
    text = open(os.path.join(session, "logs", "raylet.out")).read()

    def at(pattern: str) -> float:
        m = re.search(r"\[(\S+ \S+) [^\n]*" + pattern, text)
        return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else float("nan")

    return at("ObjectManager server started") - at("Plasma store debug dump")


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "gap":
        session = max(glob.glob("/tmp/ray/session_2*"))  # the newest start (names carry the start time)
        print(f"{sys.argv[2]} {_store_gap(session):.3f}")
        return
    if command != "ray-start":
        sys.exit("usage: probes.py gap LABEL | probes.py ray-start")
    t0 = time.perf_counter()
    from fedsweep.bench.api import start_runtime

    start_runtime(0.0, log_to_driver=False)
    start_s = time.perf_counter() - t0
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    print(json.dumps({"ray_start_s": round(start_s, 3), "store_gap_s": round(_store_gap(session), 3),
                      "retry_ms": os.environ.get("RAY_raylet_client_connect_timeout_milliseconds")}))
    ray.shutdown()


if __name__ == "__main__":
    main()
