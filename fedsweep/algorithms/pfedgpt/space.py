"""pFedGPT's search spaces (pFedGPT §4.2–4.4): which LoRA tensors each mixing weight moves.

A LoRA key reads ``<module path>.lora_A.weight``. The *module type* is the last segment of
the module path (``q_proj``, ``k_proj``, ``v_proj``, …): one weight per type is the basic
parameter space Θ_basic of stage 1 (§4.2). Each module path is one "layer i" of its type;
stage 2 clusters the layers of a type by their training features and gives each cluster
its own weight (the personalised space Θ_personalized, §4.3).
"""

from __future__ import annotations

import numpy as np

from fedsweep.lazy import torch

from fedsweep.algorithms.tensors import Params

FEATURES = ("delta_A", "delta_B", "change_A", "change_B")


def split_key(key: str) -> tuple[str, str, str]:
    """``model.layers.3.self_attn.q_proj.lora_A.weight`` -> (module path, module type, factor 'A'|'B')."""
    if ".lora_" not in key:
        raise ValueError(f"{key!r} is not a LoRA factor (pFedGPT mixes LoRA adapters)")
    module, rest = key.split(".lora_", 1)
    return module, module.rsplit(".", 1)[-1], rest[0]


def module_types(keys) -> dict[str, list[str]]:
    """Module type -> its module paths (layers), in key order."""
    out: dict[str, list[str]] = {}
    for key in keys:
        module, mtype, _ = split_key(key)
        paths = out.setdefault(mtype, [])
        if module not in paths:
            paths.append(module)
    return out


def mix(local: Params, glob: Params, weight: dict[str, float]) -> Params:
    """θ_agg = w θ_local + (1 − w) θ_global, key by key (§4.2, and per cluster §4.4)."""
    return {k: weight[k] * local[k] + (1.0 - weight[k]) * glob[k] for k in glob}


def weights_per_module_type(keys, w: dict[str, float]) -> dict[str, float]:
    """Stage 1: every tensor of module type p takes w_p."""
    return {k: float(w[split_key(k)[1]]) for k in keys}


def weights_per_cluster(keys, cluster_of: dict[str, str], w: dict[str, float]) -> dict[str, float]:
    """Stage 2: every tensor of a layer takes the weight of that layer's cluster c_{p,i}."""
    return {k: float(w[cluster_of[split_key(k)[0]]]) for k in keys}


def stage1_to_clusters(w1: dict[str, float], cluster_of: dict[str, str]) -> dict[str, float]:
    """A stage-1 point in the stage-2 space: w_{c_{p,i}} = w_p (§4.4, initialisation 1)."""
    out = {}
    for module, cluster in cluster_of.items():
        out[cluster] = float(w1[module.rsplit(".", 1)[-1]])
    return out


def layer_features(local: Params, glob: Params, local_change: Params, global_change: Params) -> dict[str, tuple[list[str], np.ndarray]]:
    """F_{p,i} = [δ_A, δ_B, Δ_A, Δ_B] per layer i of each module type p (§4.3):

    δ_X = mean_j (θ^l_X − θ^g_X)²  and  Δ_X = mean_j (Δθ^l_X − Δθ^g_X)²  for X ∈ {A, B},

    with Δθ^l the client's change over its last local training and Δθ^g the global model's
    change over the same interval. Returns type -> (layer paths, (n_layers, 4) array).
    """
    rows: dict[str, dict[str, list[float]]] = {}
    for key in glob:
        module, mtype, factor = split_key(key)
        row = rows.setdefault(mtype, {}).setdefault(module, [0.0] * 4)
        col = 0 if factor == "A" else 1
        row[col] = float(((local[key].double() - glob[key].double()) ** 2).mean())
        row[col + 2] = float(((local_change[key].double() - global_change[key].double()) ** 2).mean())
    return {mtype: (list(layers), np.array(list(layers.values()), dtype=np.float64)) for mtype, layers in rows.items()}


def group_layer_features(layout, local: torch.Tensor, glob: torch.Tensor, prev_init: torch.Tensor,
                         global_change: torch.Tensor, order: list[str]) -> list[dict[str, tuple[list[str], np.ndarray]]]:
    """:func:`layer_features` of many clients sharing one θ_g, as arrays in ``layout``: ``local`` and
    ``prev_init`` (clients, P), ``glob`` (P,), ``global_change`` (clients, P) or (1, P) (one for all); the
    layers listed in the keys' ``order`` (θ_g's, as :func:`layer_features` lists them). The same float
    arithmetic element by element and each tensor's mean over its own entries: the same features."""
    keys = list(layout.shapes)
    spans = [(layout.offsets[k], layout.offsets[k] + n) for k, n in zip(keys, layout.sizes)]
    delta = (local.double() - glob.double()) ** 2
    moved = local.float() - prev_init.float()  # Δθ^l (``changes``)
    change = (moved.double() - global_change.double()) ** 2
    means = [torch.stack([x[:, a:b].mean(dim=1) for a, b in spans]).T.tolist() for x in (delta, change)]
    out = []
    for c in range(local.shape[0]):
        rows: dict[str, dict[str, list[float]]] = {}
        for key in order:
            j = keys.index(key)
            module, mtype, factor = split_key(key)
            row = rows.setdefault(mtype, {}).setdefault(module, [0.0] * 4)
            col = 0 if factor == "A" else 1
            row[col], row[col + 2] = means[0][c][j], means[1][c][j]
        out.append({mtype: (list(layers), np.array(list(layers.values()), dtype=np.float64))
                    for mtype, layers in rows.items()})
    return out


def cluster_layers(features: dict[str, tuple[list[str], np.ndarray]], clusters: int, seed: int) -> dict[str, str]:
    """KMeans of each type's layers on their standardised features -> layer path: cluster name.

    Features are z-scored per column within the type (δ and Δ differ by orders of magnitude
    between A and B). A type gets min(clusters, distinct feature rows) clusters; names are
    ``<type>/c<j>`` numbered in order of first appearance, so they do not depend on KMeans'
    label permutation.
    """
    from sklearn.cluster import KMeans

    out: dict[str, str] = {}
    for mtype, (paths, x) in features.items():
        std = x.std(axis=0)
        z = (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0)
        k = min(clusters, len(np.unique(z.round(12), axis=0)))
        if k <= 1:
            labels = np.zeros(len(paths), dtype=int)
        else:
            labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(z)
        order: dict[int, int] = {}
        for path, label in zip(paths, labels):
            out[path] = f"{mtype}/c{order.setdefault(int(label), len(order))}"
    return out


def changes(after: Params, before: Params) -> Params:
    """Δθ = θ_after − θ_before, key by key."""
    return {k: after[k].float() - before[k].float() for k in after}
