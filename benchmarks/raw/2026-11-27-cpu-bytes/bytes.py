"""Bytes per round, both directions, for each codec (docs/federation.md's table).

FedAvg on the cpu budget's base experiment (the bundled SmolLM2-135M-Instruct, LoRA r 8 on q/k/v/o,
8 clients, 3 rounds of 6 steps), the same codec on the upload and the download, seed 0, no tracking.
Run from the repository root (it imports fedsweep's public ``fedsweep.bench.api`` since 2026-11-28; as
run on 2026-11-27 it imported the runner directly, ``git show a5670ad:benchmarks/raw/2026-11-27-cpu-bytes/bytes.py``):

    RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 python benchmarks/raw/2026-11-27-cpu-bytes/bytes.py
"""

import json
import sys
import tempfile
from pathlib import Path

from fedsweep.bench.api import load_config, run_experiment, write_json

KINDS = ["none", "fp16", "bf16", "int8", "topk"]
out_dir = Path(__file__).parent
rows = []
for kind in KINDS:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config("configs/reproductions/experiments/base_cpu.yaml", overrides=[
            f"clients.upload.compression={kind}", f"server.download.compression={kind}",
            "clients.upload.topk_fraction=0.1", "server.download.topk_fraction=0.1",
            "tracking.enabled=false", f"checkpoint.dir={tmp}/runs"])
        outcome = run_experiment(cfg)
    for r in outcome.rounds:
        m = r["metrics"]
        rows.append({"codec": kind, "round": r["round"], "bytes_up": m["bytes_up"], "bytes_down": m["bytes_down"],
                     "train_loss": m["train_loss"], "test_loss": m.get("test_loss")})
        print(json.dumps(rows[-1]), flush=True)
write_json({"rows": rows}, out_dir / "bytes.json")  # (the rows, with the commit, device and versions)
print("wrote", out_dir / "bytes.json", file=sys.stderr)
