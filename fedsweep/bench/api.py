"""What a benchmark script under ``benchmarks/`` may import of fedsweep (beside the ``fedsweep``
command): a config loaded or validated, an experiment run to its end, a run's final checkpoint read
back and compared bit for bit, the recovery bench's scripted faults, a local Ray runtime started as a
run starts it (to time that start), the benches' own entry points, and the one writer of a result's
JSON (stamped with its commit, device and versions). Scripts there import nothing else of fedsweep
(``tests/test_contract.py`` checks), so a restructuring of the internals leaves them running."""

from __future__ import annotations

from fedsweep.bench.record import write_json
from fedsweep.bench.recovery import Disturber, Kill, Timeline, bitwise_equal, final_state
from fedsweep.config import load_config, validate
from fedsweep.errors import RunError
from fedsweep.orchestrator.runner import run as run_experiment
from fedsweep.orchestrator.runtime.ray_runtime import ensure as start_runtime

__all__ = ["Disturber", "Kill", "RunError", "Timeline", "bitwise_equal", "final_state", "load_config",
           "run_experiment", "start_runtime", "validate", "write_json"]
