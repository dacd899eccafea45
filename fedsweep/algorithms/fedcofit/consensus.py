"""FedCoFiT's per-prompt semantic consensus (§3 of "Beyond Parameter Aggregation: Semantic
Consensus for Federated Fine-Tuning of LLMs"), on normalised embeddings.

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

TOL = 1e-6  # distances within this (computed in float64) count as ties


@dataclass
class Choice:
    index: int
    cluster: list[int]
    all_outliers: bool


def unit_rows(emb: np.ndarray) -> np.ndarray:
    """float64 rows renormalised to unit length (float32 encoder output is unit only to ~1e-7)."""
    e = np.asarray(emb, dtype=np.float64)
    n = np.linalg.norm(e, axis=1, keepdims=True)
    return e / np.where(n > 0, n, 1.0)


def mean_pairwise_distance(emb: np.ndarray, members: list[int]) -> float:
    if len(members) < 2:
        return 0.0
    sub = emb[members]
    d = 1.0 - sub @ sub.T
    iu = np.triu_indices(len(members), 1)
    return float(d[iu].mean())


def _within(values: dict[int, float]) -> list[int]:
    """Keys whose value is within TOL of the least value."""
    best = min(values.values())
    return [i for i, v in values.items() if v <= best + TOL]


def consensus_cluster(emb: np.ndarray, eps: float, min_samples: int) -> tuple[list[int], bool]:
    from sklearn.cluster import DBSCAN

    labels = DBSCAN(eps=eps, min_samples=min_samples, metric="cosine").fit(emb).labels_
    clusters: dict[int, list[int]] = {}
    for i, lab in enumerate(labels):
        if lab >= 0:
            clusters.setdefault(int(lab), []).append(i)
    if not clusters:
        return list(range(len(emb))), True
    largest = max(len(m) for m in clusters.values())
    cands = {lab: m for lab, m in clusters.items() if len(m) == largest}
    tight = _within({lab: mean_pairwise_distance(emb, m) for lab, m in cands.items()})
    best = min((cands[lab] for lab in tight), key=min)
    return sorted(best), False


def nearest(scores: np.ndarray, candidates: list[int], lengths: list[int]) -> int:
    """The candidate of least score (ties within TOL) → shortest response → smallest index."""
    tied = _within({i: float(scores[i]) for i in candidates})
    return min(tied, key=lambda i: (lengths[i], i))


def choose(emb: np.ndarray, lengths: list[int], eps: float, min_samples: int, selection: str = "centroid",
           rng: np.random.Generator | None = None, eligible: list[int] | None = None) -> Choice:
    """The pseudo-label's client index for one prompt (``emb``: K×d sentence embeddings).

    Everything runs in float64 on renormalised rows, and distances within ``TOL`` tie, so
    identical responses tie exactly: [Lyon, Lyon, Paris, Paris] → the Lyon cluster (smallest
    client index). ``eligible``: the responses that may take part (others are ignored);
    default all.
    """
    emb = unit_rows(emb)
    idx = list(range(len(emb))) if eligible is None else sorted(eligible)
    sub = emb[idx]
    lens = [lengths[i] for i in idx]
    if selection == "global_medoid":
        k = len(sub)
        d = 1.0 - sub @ sub.T
        mean = (d.sum(axis=1) - np.diag(d)) / max(k - 1, 1)
        return Choice(idx[nearest(mean, list(range(k)), lens)], idx, False)
    members, outliers = consensus_cluster(sub, eps, min_samples)
    if selection == "random_in_majority":
        rng = rng or np.random.default_rng(0)
        return Choice(idx[int(rng.choice(members))], [idx[m] for m in members], outliers)
    centroid = sub[members].sum(axis=0)
    centroid = centroid / max(np.linalg.norm(centroid), 1e-300)
    dist = 1.0 - sub @ centroid
    return Choice(idx[nearest(dist, members, lens)], [idx[m] for m in members], outliers)
