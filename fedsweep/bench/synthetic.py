"""``fedsweep bench``: measured speed, written as JSON under results/bench/.

``bench aggregation`` times one server aggregation step of a method on synthetic client
uploads of a real model's LoRA shape (default: Llama-3.1-8B, r=16 on q/k/v/o, 13.6 M
parameters per client), for several client counts. The time covers everything the
plugin's ``aggregate`` does — for DRIFT: divergences, graph creation, graph search and
the weighted aggregation, as the paper's Table 6 counts it — and excludes artifact
rendering, which a run can switch off.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from fedsweep.algorithms import registry
from fedsweep.algorithms.types import AggregationContext, ClientInfo, ClientResult, ServerContext, Upload
from fedsweep.models.shapes import load_model_config, lora_shapes, reft_shapes

TARGETS = {"drift": (16, 0.5, "cpu"), "drift@cuda": (16, 0.05, "cuda")}  # targets: (K, seconds, device), docs/gpu.md


def synthetic_uploads(shapes: dict[str, tuple[int, ...]], k: int, device: str, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """K clients' adapters: small Gaussian factors, distinct per client (as after local training)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(k):
        out.append({n: (torch.randn(s, generator=g) * 0.02).to(device) for n, s in shapes.items()})
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def bench_aggregation(algorithm: str, clients: list[int], hp: dict[str, Any], model: str = "llama-3.1-8b",
                      rank: int = 16, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                      repeats: int = 3, device: str = "cpu",
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    cls = registry.get(algorithm)
    if "artifacts" in cls.Params.model_fields:
        hp = {"artifacts": False, **hp}
    params = cls.Params.model_validate(hp)
    adapter = "lora" if "lora" in cls.capabilities.adapters else "reft"
    mcfg = load_model_config(model)
    shapes = lora_shapes(mcfg, rank, list(targets)) if adapter == "lora" else reft_shapes(mcfg, rank)
    per_client = sum(torch.Size(s).numel() for s in shapes.values())
    rows = []
    for k in clients:
        uploads = synthetic_uploads(shapes, k, device)
        results = [ClientResult(cid=i, num_examples=100, upload=Upload(params=u)) for i, u in enumerate(uploads)]
        seconds, breakdown = [], []
        algo = cls(params)
        state = algo.init(uploads[0], ServerContext([ClientInfo(i, 100) for i in range(k)]))
        # consecutive rounds on one server state, as a running server does; the first round
        # (which also allocates the state's buffers) warms caches and is not counted
        for rep in range(repeats + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            state, report = algo.aggregate(rep + 1, results, state)
            if device == "cuda":
                torch.cuda.synchronize()
            if rep:
                seconds.append(time.perf_counter() - t0)
                breakdown.append({m: v for m, v in report.metrics.items() if m.endswith("_seconds")})
        row = {"clients": k, "seconds_median": statistics.median(seconds), "seconds_min": min(seconds),
               "seconds_all": seconds}
        if breakdown and breakdown[0]:
            row["breakdown_median"] = {m: statistics.median(b[m] for b in breakdown) for m in breakdown[0]}
        rows.append(row)
        if progress:
            progress(f"K={k}: {row['seconds_median']:.3f} s (median of {repeats})")
        del uploads, results
    out = {"benchmark": "aggregation", "algorithm": algorithm, "hparams": params.model_dump(), "device": device,
           "model": model, "adapter": adapter, "rank": rank,
           "targets": list(targets) if adapter == "lora" else "all layers, tied", "tensors_per_client": len(shapes),
           "params_per_client": per_client, "repeats": repeats, "results": rows, "machine": machine(),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    target = TARGETS.get(algorithm + ("@cuda" if device == "cuda" else ""))
    if target:
        k_target, limit, _ = target
        hit = next((r for r in rows if r["clients"] == k_target), None)
        if hit:
            out["target"] = {"clients": k_target, "seconds": limit, "measured": hit["seconds_median"],
                             "met": hit["seconds_median"] <= limit}
    return out


def write(result: dict[str, Any], out_dir: str = "results/bench") -> Path:
    name = f"{result['benchmark']}_{result['algorithm']}"
    if "variant" in result.get("hparams", {}):
        name += f"_{result['hparams']['variant']}"
    from fedsweep.bench.record import write_json

    return write_json(result, Path(out_dir) / f"{name}_{result['device']}.json")


def synthetic_responses(clients: int, prompts: int, seed: int = 0) -> list[list[str]]:
    """K×M short answers: per prompt a majority phrasing, paraphrases, and some off-topic outliers."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["apple", "river", "engine", "violet", "market", "planet", "copper", "lantern", "harbor", "meadow"]
    out = [[] for _ in range(clients)]
    for j in range(prompts):
        answer = int(rng.integers(0, 10_000))
        topic = words[j % len(words)]
        for k in range(clients):
            roll = rng.random()
            if roll < 0.6:
                text = f"The answer is {answer}."
            elif roll < 0.85:
                text = f"It equals {answer}, computed from the {topic} numbers."
            else:
                text = f"I think the {words[int(rng.integers(0, len(words)))]} is {int(rng.integers(0, 99))} metres long."
            out[k].append(text)
    return out


def bench_consensus(clients: int, prompts: int, repeats: int = 3, progress=None) -> dict[str, Any]:
    """FedCoFiT's server step (one batched embedding of K·M responses, per-prompt DBSCAN, selection)."""
    from fedsweep.algorithms.fedcofit import FedCoFiT
    from fedsweep.models.encoder import load_encoder

    algo = FedCoFiT()
    embed = load_encoder(algo.hp.encoder)
    texts = synthetic_responses(clients, prompts)
    public = [{"prompt": f"prompt {j}"} for j in range(prompts)]
    results = [ClientResult(cid=k, num_examples=1, upload=Upload(texts=texts[k])) for k in range(clients)]
    embed(texts[0][:8])  # warm up
    seconds, embed_s, cluster_s = [], [], []
    for rep in range(repeats):
        state = algo.init({}, ServerContext([ClientInfo(k, 1) for k in range(clients)], public=public, embed=embed))
        t0 = time.perf_counter()
        _, report = algo.aggregate(1, results, state, AggregationContext(embed=embed))
        seconds.append(time.perf_counter() - t0)
        embed_s.append(report.metrics["consensus_embed_seconds"])
        cluster_s.append(report.metrics["consensus_cluster_seconds"])
        if progress:
            progress(f"repeat {rep + 1}: {seconds[-1]:.2f} s")
    return {"benchmark": "consensus", "algorithm": "fedcofit", "device": "cpu", "clients": clients, "prompts": prompts,
            "responses": clients * prompts, "encoder": algo.hp.encoder, "hparams": algo.hp.model_dump(),
            "seconds_median": statistics.median(seconds), "seconds_all": seconds,
            "embed_seconds_median": statistics.median(embed_s), "cluster_seconds_median": statistics.median(cluster_s),
            "consensus_cluster_size_mean": report.metrics["consensus_cluster_size_mean"],
            "machine": machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _pickle5_round_trip(obj) -> Any:
    """Pickle and unpickle as Ray moves an object: protocol 5, buffers out of band and read-only."""
    import pickle

    buffers: list = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[b.raw().toreadonly() for b in buffers])


def bench_transport(model: str = "smollm2-135m-instruct", rank: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                    repeats: int = 50) -> dict[str, Any]:
    """Seconds to pickle and unpickle one client's adapter (a ``Payload`` of a real LoRA shape), as a
    client actor receives it and the server receives the upload: fedsweep's wire format (numpy
    buffers, ``algorithms.tensors.to_wire``) against torch's own pickling of the same tensors."""
    from fedsweep.algorithms.types import Payload

    cfg = load_model_config(model)
    params = synthetic_uploads(lora_shapes(cfg, rank, targets), 1, "cpu")[0]
    ways = {"fedsweep_wire": lambda: _pickle5_round_trip(Payload(params=params)).params,
            "torch_pickle": lambda: _pickle5_round_trip(params)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):  # alternating, so drift in the machine's speed hits both alike
        for name, way in ways.items():
            t0 = time.perf_counter()
            got = way()
            seconds[name].append(time.perf_counter() - t0)
            assert all(torch.equal(got[k], params[k]) for k in params), name
    med = {name: statistics.median(v) for name, v in seconds.items()}
    return {"benchmark": "transport", "algorithm": model, "device": "cpu", "model": model, "rank": rank, "targets": list(targets),
            "tensors": len(params), "params": sum(t.numel() for t in params.values()),
            "bytes": sum(t.numel() * t.element_size() for t in params.values()), "repeats": repeats,
            **{f"{name}_seconds_median": v for name, v in med.items()},
            **{f"{name}_seconds_min": min(v) for name, v in seconds.items()},
            "torch_over_wire": med["torch_pickle"] / med["fedsweep_wire"], "machine": machine(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
