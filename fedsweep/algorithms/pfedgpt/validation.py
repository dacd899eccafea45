"""pFedGPT's validation sets (pFedGPT §4.1 and App. B) and its slow-start test (§4.5).

V_high: the ``n`` items of the global validation pool most similar to the client's data
(cosine similarity of unit-norm sentence embeddings, averaged over the client's examples,
i.e. the cosine to the client's mean embedding up to a common scale).
V_low: KMeans on V_high's embeddings with k of best silhouette, then from every cluster c
n_c = ⌊T · N_c / |V|⌋ items with T = ⌊ratio · |V|⌋ (eq. 1).
"""

from __future__ import annotations

import numpy as np

from fedsweep.lazy import torch


def most_similar(local: torch.Tensor, pool: torch.Tensor, n: int) -> list[int]:
    """Indices of the ``n`` pool rows of highest mean cosine similarity to the local rows
    (both unit-norm), best first; ties by the smaller index."""
    score = (pool.double() @ local.double().T).mean(dim=1).numpy()
    order = np.lexsort((np.arange(len(score)), -score))
    return order[: min(n, len(score))].tolist()


def silhouette_kmeans(x: np.ndarray, k_max: int, seed: int) -> tuple[int, np.ndarray]:
    """(k, labels): KMeans for k = 2 … min(k_max, n − 1), keeping the k of largest silhouette
    score (ties: smaller k). Fewer than 3 points, or all identical: one cluster."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    n = len(x)
    distinct = len(np.unique(np.round(x, 10), axis=0))
    best = (1, np.zeros(n, dtype=int), -np.inf)
    for k in range(2, min(k_max, n - 1, distinct) + 1):
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x)
        if len(set(labels.tolist())) < 2:
            continue
        s = float(silhouette_score(x, labels))
        if s > best[2] + 1e-12:
            best = (k, labels, s)
    return best[0], best[1]


def proportional_sample(labels: np.ndarray, ratio: float, seed: int) -> list[int]:
    """Eq. (1): T = ⌊ratio·|V|⌋, n_c = ⌊T · N_c / |V|⌋ drawn without replacement from cluster c.

    Positions into ``labels``, sorted. If every n_c rounds down to 0, one item of the
    largest cluster is kept so that the low-fidelity set is never empty."""
    rng = np.random.default_rng(seed)
    size = len(labels)
    total = int(np.floor(ratio * size))
    picked: list[int] = []
    clusters, counts = np.unique(labels, return_counts=True)
    for c, count in zip(clusters.tolist(), counts.tolist()):
        n_c = int(np.floor(total * count / size))
        members = np.flatnonzero(labels == c)
        picked.extend(rng.choice(members, size=min(n_c, len(members)), replace=False).tolist())
    if not picked and size:
        members = np.flatnonzero(labels == clusters[np.argmax(counts)])
        picked = [int(rng.choice(members))]
    return sorted(picked)


def relative_change(losses: list[float], window: int, eps: float = 1e-8) -> float | None:
    """Δ_t = |mean(L_t) − mean(L_{t−1})| / max(mean(L_{t−1}), ε) (§4.5), L_t and L_{t−1} the current
    and the previous sliding window of ``window`` losses, one step apart (stride 1: they share
    window − 1 losses); ``None`` until window + 1 losses exist."""
    if len(losses) < window + 1:
        return None
    current = float(np.mean(losses[-window:]))
    previous = float(np.mean(losses[-window - 1:-1]))
    return abs(current - previous) / max(previous, eps)


def slow_start_over(losses: list[float], rnd: int, window: int, delta_max: float, t_max: int) -> bool:
    """SlowStart(t) of §4.5: True (the client has enough global knowledge and starts HBO) when
    Δ_t < δ_max or t ≥ T_max."""
    change = relative_change(losses, window)
    return rnd >= t_max or (change is not None and change < delta_max)
