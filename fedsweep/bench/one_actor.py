"""The benches' one-actor config: every client of a bench on one actor, grouped (``bench throughput``,
``bench.method_round``, ``bench.ideal``)."""

from __future__ import annotations


def packed_config(cfg, k: int):
    """``cfg`` with ``k`` clients all on one actor, grouped by ``auto`` (per-client ranks cycled to k;
    fewer clients than tasks: an iid split)."""
    from fedsweep.config import validate

    raw = cfg.to_dict()
    raw["clients"] = {**raw["clients"], "num_clients": k, "clients_per_actor": k, "num_actors": "auto"}
    raw["train"] = {**raw["train"], "batch_clients": "auto" if raw["train"]["batch_clients"] in ("off", 1)
                    else raw["train"]["batch_clients"], "batch_reason": None}
    if raw["lora"].get("ranks"):
        raw["lora"]["ranks"] = [raw["lora"]["ranks"][i % len(raw["lora"]["ranks"])] for i in range(k)]
    if raw["partition"]["scheme"] == "task" and k < len(raw["data"]["tasks"]):
        raw["partition"]["scheme"] = "iid"
    return validate(raw)
