"""FedCoFiT's per-prompt semantic consensus (seed 002, §3), on normalised embeddings.

For one public prompt with K client responses e_1..e_K (unit vectors), cosine distance
dist(e, e') = 1 − eᵀe':

1. DBSCAN(eps, min_samples, cosine). Consensus cluster C* = the largest non-outlier
   cluster; ties → smallest mean pairwise cosine distance → smallest client index. If
   every response is an outlier, C* = all responses.
2. ``centroid`` (default): normalised centroid ē of C*; pseudo-label = the response
   nearest to ē, ties → shortest response → smallest client index.
   ``random_in_majority``: a uniformly random member of C* (Table 4, row ii).
   ``global_medoid``: ignore clusters; the response with the smallest mean distance to
   all others, ties → shortest → smallest index (Table 4, row iii).

Pure numpy/scikit-learn: embeddings in, the chosen client index out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIGITS = 9  # distances equal to 1e-9 count as ties


@dataclass
class Choice:
    index: int
    cluster: list[int]
    all_outliers: bool


def mean_pairwise_distance(emb: np.ndarray, members: list[int]) -> float:
    if len(members) < 2:
        return 0.0
    sub = emb[members]
    d = 1.0 - sub @ sub.T
    iu = np.triu_indices(len(members), 1)
    return float(d[iu].mean())


def consensus_cluster(emb: np.ndarray, eps: float, min_samples: int) -> tuple[list[int], bool]:
    from sklearn.cluster import DBSCAN

    labels = DBSCAN(eps=eps, min_samples=min_samples, metric="cosine").fit(emb).labels_
    clusters: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        if lab >= 0:
            clusters.setdefault(int(lab), []).append(i)
    if not clusters:
        return list(range(len(emb))), True
    best = min(clusters.values(),
               key=lambda m: (-len(m), round(mean_pairwise_distance(emb, m), DIGITS), min(m)))
    return sorted(best), False


def nearest(scores: np.ndarray, candidates: list[int], lengths: list[int]) -> int:
    return min(candidates, key=lambda i: (round(float(scores[i]), DIGITS), lengths[i], i))


def choose(emb: np.ndarray, lengths: list[int], eps: float, min_samples: int, selection: str = "centroid",
           rng: np.random.Generator | None = None) -> Choice:
    """The pseudo-label's client index for one prompt (``emb``: K×d, rows unit-norm)."""
    if selection == "global_medoid":
        k = len(emb)
        d = 1.0 - emb @ emb.T
        mean = (d.sum(axis=1) - np.diag(d)) / max(k - 1, 1)
        return Choice(nearest(mean, list(range(k)), lengths), list(range(k)), False)
    members, outliers = consensus_cluster(emb, eps, min_samples)
    if selection == "random_in_majority":
        rng = rng or np.random.default_rng(0)
        return Choice(int(rng.choice(members)), members, outliers)
    centroid = emb[members].sum(axis=0)
    centroid = centroid / max(np.linalg.norm(centroid), 1e-12)
    dist = 1.0 - emb @ centroid
    return Choice(nearest(dist, members, lengths), members, outliers)
