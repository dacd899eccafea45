"""One local runtime's start as ``fedsweep run`` starts it (``ray_runtime.ensure``), timed, with the raylet's
wait between its object store and its object manager; printed as JSON, then the runtime stopped."""
import json
import os
import re
import time
from datetime import datetime

t0 = time.perf_counter()
from fedsweep.orchestrator.runtime import ray_runtime  # noqa: E402

ray_runtime.ensure(0.0, log_to_driver=False)
start_s = time.perf_counter() - t0
import ray  # noqa: E402

text = open(os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "raylet.out")).read()


def at(pattern: str) -> float:
    m = re.search(r"\[(\S+ \S+) [^\n]*" + pattern, text)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else float("nan")


print(json.dumps({"ray_start_s": round(start_s, 3),
                  "store_gap_s": round(at("ObjectManager server started") - at("Plasma store debug dump"), 3),
                  "retry_ms": os.environ.get("RAY_raylet_client_connect_timeout_milliseconds")}))
ray.shutdown()
