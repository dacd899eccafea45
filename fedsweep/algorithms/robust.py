"""Byzantine-robust rules over the clients' updates Δ_k = θ_k − θ_start,k, applied before a method's own
aggregation (``server.robust``). Pure tensor code.

Every rule works on the update a client uploads — its LoRA factors A and B as they are, not their
product B·A: the product is what the base sees, but it is bilinear, so a robust statistic of products
is not the product of robust statistics, and what arrives and what the method averages are the
factors. Distances and norms are over the flattened update (all of a client's tensors, concatenated
in key order): a coordinated attack on one tensor shows in the client's whole vector.

* ``median`` — the coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates"): each entry the median of the K clients' entries (the mean of
  the two middle ones for even K). Every accepted client's update becomes it.
* ``trimmed_mean`` — the coordinate-wise β-trimmed mean (ibid.): drop the ⌊βK⌋ largest and ⌊βK⌋
  smallest values of each entry, average the rest; every accepted update becomes it.
* ``krum`` / ``multi_krum`` (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
  Tolerant Gradient Descent"): client k's score is the sum of the squared distances to its
  K − f − 2 nearest other clients; Krum keeps the lowest-scoring client, Multi-Krum the m lowest
  (ties: the smaller index first). Needs K ≥ 2f + 3. The kept clients' updates go to the method.
* ``norm_bound`` — each update scaled by min(1, B/‖Δ_k‖) (Sun et al. 2019, "Can You Really Backdoor
  Federated Learning?"); B a number, or ``median`` (the median of the round's update norms).

Coordinate-wise rules replace every update by one centre, so they are defined for methods that
average the uploads into one model; a personalised method's aggregation is not an average of what
each client sent and refuses them (``ServerSection``'s check); Krum and norm bounding select or
shrink updates and apply to any method that exchanges parameters.
"""

from __future__ import annotations

import math

from fedsweep.algorithms.tensors import Params
from fedsweep.lazy import torch


def flatten(update: Params) -> torch.Tensor:
    """All of an update's tensors in one float64 vector, keys in sorted order."""
    return torch.cat([update[k].reshape(-1).double() for k in sorted(update)])


def coordinate_median(updates: list[Params]) -> Params:
    """Each entry the median over clients (the mean of the two middle values for an even count)."""
    out = {}
    for key in updates[0]:
        x = torch.stack([u[key].double() for u in updates]).sort(dim=0).values
        k = x.shape[0]
        mid = x[k // 2] if k % 2 else (x[k // 2 - 1] + x[k // 2]) / 2
        out[key] = mid.to(updates[0][key].dtype)
    return out


def trimmed_mean(updates: list[Params], beta: float) -> Params:
    """Each entry's mean after dropping the ⌊βK⌋ smallest and ⌊βK⌋ largest values."""
    k = len(updates)
    cut = int(math.floor(beta * k))
    if 2 * cut >= k:
        raise ValueError(f"trimmed mean with beta={beta} drops every one of {k} updates")
    out = {}
    for key in updates[0]:
        x = torch.stack([u[key].double() for u in updates]).sort(dim=0).values
        out[key] = x[cut:k - cut].mean(dim=0).to(updates[0][key].dtype)
    return out


def krum_scores(updates: list[Params], f: int) -> list[float]:
    """Client k's Krum score: the sum of its squared distances to its K − f − 2 nearest other clients."""
    k = len(updates)
    if k < 2 * f + 3:
        raise ValueError(f"Krum with f={f} needs at least 2f + 3 = {2 * f + 3} clients, the round has {k}")
    x = torch.stack([flatten(u) for u in updates])
    d = torch.cdist(x, x).pow(2)
    scores = []
    for i in range(k):
        others = torch.cat([d[i, :i], d[i, i + 1:]]).sort().values
        scores.append(float(others[: k - f - 2].sum()))
    return scores


def krum(updates: list[Params], f: int, m: int = 1) -> list[int]:
    """The indices of the ``m`` lowest Krum scores (Krum: m = 1), ties to the smaller index."""
    scores = krum_scores(updates, f)
    return sorted(sorted(range(len(updates)), key=lambda i: (scores[i], i))[:m])


def norm_bound(updates: list[Params], bound: float) -> tuple[list[Params], list[float]]:
    """Each update scaled by min(1, bound/‖Δ‖); (the updates, the scale each got)."""
    out, scales = [], []
    for u in updates:
        norm = float(flatten(u).norm())
        s = 1.0 if norm <= bound or norm == 0 else bound / norm
        out.append({k: v * s for k, v in u.items()})
        scales.append(s)
    return out, scales


def median_norm(updates: list[Params]) -> float:
    """The median of the updates' norms (the mean of the two middle ones for an even count)."""
    norms = sorted(float(flatten(u).norm()) for u in updates)
    k = len(norms)
    return norms[k // 2] if k % 2 else (norms[k // 2 - 1] + norms[k // 2]) / 2
