"""``fedsweep bench checkpoint``: seconds to checkpoint one round of K clients' state.

Each client holds a real model's LoRA shape and the AdamW state one step leaves (two moments
and a step counter per tensor), as after a round of local training. Two ways are timed,
alternating, in a scratch folder on the disk the run's checkpoints would use:

- ``fedsweep``: what a client actor and the server do (``client_state.save_slots``, then
  ``checkpoint.commit`` with the digests the writers computed);
- ``safetensors_save_file``: the same files written with ``safetensors.torch.save_file``, one
  after another, and a manifest hashed by reading the round back (what the project did before).

Both are checked to hold the same tensors as the clients (read back with safetensors' loader).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from fedsweep import checkpoint as ckpt
from fedsweep.actors.client_state import ClientSlot, save_slots
from fedsweep.bench.synthetic import machine, synthetic_uploads
from fedsweep.models.shapes import load_model_config, lora_shapes


def trained_slots(model: str, rank: int, targets: tuple[str, ...], clients: int, device: str) -> dict[int, ClientSlot]:
    """K clients whose adapters and AdamW state are what one optimiser step leaves."""
    shapes = lora_shapes(load_model_config(model), rank, list(targets))
    slots = {}
    for cid, params in enumerate(synthetic_uploads(shapes, clients, device, seed=1)):
        live = [torch.nn.Parameter(v.clone()) for v in params.values()]
        opt = torch.optim.AdamW(live)
        for p in live:
            p.grad = torch.randn_like(p)
        opt.step()
        slots[cid] = ClientSlot(cid=cid, train=[], test=[], train_enc=[], test_enc=[], params=params,
                                rank=rank, opt_state=opt.state_dict())
    return slots


def _with_save_file(slots: dict[int, ClientSlot], root: Path, rnd: int) -> None:
    stage = ckpt.staging_dir(root, rnd)
    for cid, slot in slots.items():
        tensors, meta = ckpt.optimizer_to_tensors(slot.opt_state)
        flat = ckpt.flatten({"params": slot.params, "opt": tensors})
        path = stage / f"client_{cid:05d}.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in flat.items()}, str(path))
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())
        ckpt.write_json(stage / f"client_{cid:05d}.json", {"cid": cid, "optimizer": meta})
    ckpt.commit(root, rnd, keep=1)  # the manifest reads every file back


def _with_fedsweep(slots: dict[int, ClientSlot], root: Path, rnd: int) -> None:
    for slot in slots.values():
        slot.saved_as = None  # every client trained this round: nothing to reuse
    saved = save_slots(slots, str(ckpt.staging_dir(root, rnd)), None)
    ckpt.commit(root, rnd, keep=1, known=saved["files"])


def _check(slots: dict[int, ClientSlot], root: Path) -> None:
    folder = ckpt.latest(root)
    assert folder is not None and ckpt.verify(folder) is None
    for cid in (0, len(slots) - 1):
        back = ckpt.nest(load_file(str(folder / f"client_{cid:05d}.safetensors")))["params"]
        assert all(torch.equal(back[k], v.cpu()) for k, v in slots[cid].params.items()), cid


def bench_checkpoint(model: str = "smollm2-135m-instruct", rank: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                     clients: int = 50, repeats: int = 3, device: str = "cpu", scratch: str = "results/bench/checkpoint-scratch",
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Median seconds of one round's checkpoint of ``clients`` clients, both ways (module docstring)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    slots = trained_slots(model, rank, targets, clients, device)
    ways = {"fedsweep": _with_fedsweep, "safetensors_save_file": _with_save_file}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    root = Path(scratch)
    shutil.rmtree(root, ignore_errors=True)
    try:
        for rep in range(repeats):  # alternating, so drift in the machine's speed hits both alike
            for name, way in ways.items():
                rnd = len(seconds[name]) + 1
                t0 = time.perf_counter()
                way(slots, root / name, rnd)
                seconds[name].append(time.perf_counter() - t0)
                _check(slots, root / name)
            if progress:
                progress(f"repeat {rep + 1}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()))
        folder = ckpt.latest(root / "fedsweep")
        size = sum(f.stat().st_size for f in folder.iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in seconds.items()}
    first = ckpt.flatten({"params": slots[0].params, "opt": ckpt.optimizer_to_tensors(slots[0].opt_state)[0]})
    return {"benchmark": "checkpoint", "algorithm": model, "device": device, "model": model, "rank": rank,
            "targets": list(targets), "clients": clients, "tensors_per_client": len(first), "round_bytes": size,
            "repeats": repeats, **{f"{name}_seconds_median": v for name, v in med.items()},
            **{f"{name}_seconds_all": v for name, v in seconds.items()},
            "save_file_over_fedsweep": med["safetensors_save_file"] / med["fedsweep"], "machine": machine(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
