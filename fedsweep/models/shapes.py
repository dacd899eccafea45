"""Adapter tensor shapes computed from a model config alone (no weights, no download)."""

from __future__ import annotations

import json
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"

OPTIMIZER_BYTES = {"adamw": 8.0, "adamw_8bit": 2.0 + 8 / 2048, "sgd": 0.0}
"""Optimiser state per trainable parameter: AdamW two fp32 moments; 8-bit AdamW two uint8 moments
plus an fp32 scale per 2048-value block; SGD without momentum none."""


def load_model_config(name_or_path: str) -> dict:
    """A model config JSON by path, or by name from configs/models/."""
    path = Path(name_or_path)
    if not path.is_file():
        path = MODELS_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in MODELS_DIR.glob("*.json"))
        raise ValueError(f"model config {name_or_path!r} not found (a JSON path, or one of: {', '.join(known)})")
    return json.loads(path.read_text())


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-style decoder layer (grouped-query attention aware)."""
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads) * head_dim
    inter = cfg["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def lora_shapes(cfg: dict, r: int, targets: list[str]) -> dict[str, tuple[int, ...]]:
    """Adapter name -> shape, named as fedsweep names LoRA tensors (A: r×in, B: out×r)."""
    shapes = linear_shapes(cfg)
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"unknown target modules {unknown} (known: {', '.join(shapes)})")
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in targets:
            block = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            fan_in, fan_out = shapes[t]
            prefix = f"model.layers.{layer}.{block}.{t}"
            out[f"{prefix}.lora_A.weight"] = (r, fan_in)
            out[f"{prefix}.lora_B.weight"] = (fan_out, r)
    return out


def reft_shapes(cfg: dict, r: int, tied: bool = True) -> dict[str, tuple[int, ...]]:
    """LoReFT tensor name -> shape on every layer (W, R: r×d; b: r), as fedsweep names them."""
    d = cfg["hidden_size"]
    groups = ("all",) if tied else ("first", "last")
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for g in groups:
            out[f"reft.layers.{layer}.{g}.W"] = (r, d)
            out[f"reft.layers.{layer}.{g}.R"] = (r, d)
            out[f"reft.layers.{layer}.{g}.b"] = (r,)
    return out


TINY_VOCAB = 259
"""The tiny model's byte-level vocabulary: 256 byte symbols and 3 specials."""


def is_tiny(name: str) -> bool:
    return name == "tiny" or name.startswith("tiny@")


RANDOM = "random:"
"""``model.name: random:<architecture>``: an architecture of configs/models/ with random weights."""


def is_random(name: str) -> bool:
    return name.startswith(RANDOM)


def made_in_code(name: str) -> bool:
    """Whether ``name`` is built in code (tiny, random weights): no files to load or convert."""
    return is_tiny(name) or is_random(name)


def tiny_shape(model_cfg):
    """``tiny`` uses ``model.tiny``; ``tiny@96x3`` a tiny model of hidden size 96 and 3 layers."""
    from fedsweep.errors import ModelError

    if "@" not in model_cfg.name:
        return model_cfg.tiny
    spec = model_cfg.name.split("@", 1)[1]
    try:
        hidden, layers = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ModelError(f"model name {model_cfg.name!r}: expected tiny@HIDDENxLAYERS, e.g. tiny@96x3") from None
    return model_cfg.tiny.model_copy(update={"hidden_size": hidden, "num_layers": layers,
                                             "intermediate_size": 2 * hidden})


def architecture(model_cfg) -> dict | None:
    """The architecture dict of ``model.name`` without loading anything: the tiny model's shape, or
    ``configs/models/<name>.json``, or a local model directory's ``config.json``; None if unknown
    (a hub id not yet downloaded)."""
    if is_tiny(model_cfg.name):
        t = tiny_shape(model_cfg)
        return {"model_type": "llama", "vocab_size": TINY_VOCAB, "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_layers,
                "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
                "tie_word_embeddings": True}
    try:
        return load_model_config(model_cfg.name.removeprefix(RANDOM))
    except ValueError:
        path = Path(model_cfg.name) / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None


def base_parameters(arch: dict) -> int:
    """Parameters of a Llama-style decoder: embeddings (and an untied head), the projections, norms."""
    hidden, vocab = arch["hidden_size"], arch["vocab_size"]
    per_layer = sum(a * b for a, b in linear_shapes(arch).values()) + 2 * hidden
    head = 0 if arch.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + head + arch["num_hidden_layers"] * per_layer + hidden
