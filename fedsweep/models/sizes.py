"""``fedsweep params``: trainable and communicated sizes from a model config alone.

No weights are loaded: shapes come from the config's architecture fields
(``models.shapes``). For LoRA, the exact count follows the real projection shapes
(grouped-query attention makes k/v narrower); ``paper_lora_bytes`` is the estimate the
FedCoFiT paper uses (every attention projection d×d, every MLP projection d×d_ff),
shown beside it. ``consensus_bytes`` is FedCoFiT's 2·K·M·ℓ̄·c_t.
"""

from __future__ import annotations

from fedsweep.models.shapes import linear_shapes, lora_shapes

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_count(cfg: dict, rank: int, targets: list[str]) -> tuple[int, dict[str, int]]:
    """Exact LoRA parameter count, in total and per target module type."""
    per: dict[str, int] = {}
    for name, shape in lora_shapes(cfg, rank, targets).items():
        t = name.split(".")[-3]
        per[t] = per.get(t, 0) + shape[0] * shape[1]
    return sum(per.values()), per


def paper_lora_bytes(cfg: dict, rank: int, targets: list[str], bytes_per_param: int) -> int:
    """c · L · r · Σ_targets (d_in + d_out) with attention taken as d×d and the MLP as d×d_ff."""
    d, dff, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    per_layer = sum((d + d) if t in ATTN else (d + dff) for t in targets)
    return bytes_per_param * layers * rank * per_layer


def consensus_bytes(clients: int, prompts: int, tokens: int, bytes_per_token: float) -> int:
    """FedCoFiT's per-round upload plus download, 2·K·M·ℓ̄·c_t."""
    return int(2 * clients * prompts * tokens * bytes_per_token)


def mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f} MiB"


def lora_report(cfg: dict, rank: int, targets: list[str], bytes_per_param: int, clients: int, prompts: int,
                tokens: int, bytes_per_token: float) -> dict:
    total, per = lora_count(cfg, rank, targets)
    exact = total * bytes_per_param
    paper = paper_lora_bytes(cfg, rank, targets, bytes_per_param)
    sc = consensus_bytes(clients, prompts, tokens, bytes_per_token)
    return {"adapter": "lora", "rank": rank, "targets": targets, "trainable_params": total, "per_module": per,
            "upload_bytes_per_client": exact, "paper_estimate_upload_bytes": paper,
            "round_bytes_all_clients": 2 * clients * exact, "consensus_round_bytes": sc,
            "lora_over_consensus": 2 * clients * exact / sc if sc else None,
            "shapes": {t: linear_shapes(cfg)[t] for t in targets}}


def model_total_params(cfg: dict) -> int:
    """All parameters of the model a config describes, instantiated on the meta device (no memory)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from fedsweep.models.memory import hf_config

    hf = hf_config(cfg)
    encoder = cfg["model_type"] in ("roberta", "bert", "xlm-roberta", "deberta-v2", "electra")
    with torch.device("meta"):
        model = (AutoModel if encoder else AutoModelForCausalLM).from_config(hf)
    return sum(p.numel() for p in model.parameters())


def reft_report(cfg: dict, rank: int, tied: bool, share: list[str], layers: list[int] | None,
                bytes_per_param: int) -> dict:
    """Trainable LoReFT parameters (counted on the meta device) and the shared part's bytes."""
    from fedsweep.models.reft import count_parameters

    d, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    total = count_parameters(d, n_layers, rank, tied, layers)
    per_intervention = {"W": rank * d, "R": rank * d, "b": rank}
    n_int = total // sum(per_intervention.values())
    shared = n_int * sum(per_intervention[t] for t in share)
    model_params = model_total_params(cfg)
    return {"adapter": "reft", "rank": rank, "tied": tied, "layers": layers or "all", "interventions": n_int,
            "trainable_params": total, "trainable_millions": round(total / 1e6, 4), "model_params": model_params,
            "model_millions": round(model_params / 1e6, 2), "trainable_percent": round(100 * total / model_params, 4),
            "shared": share, "upload_bytes_per_client": shared * bytes_per_param}
