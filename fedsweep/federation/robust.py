"""Byzantine-robust rules over the clients' updates Δ_k = θ_k − θ_start,k, applied before a method's own
aggregation (``server.robust``). Pure tensor code.

Every rule works on the update a client uploads — its LoRA factors A and B as they are, not their
product B·A: the product is what the base sees, but it is bilinear, so a robust statistic of products
is not the product of robust statistics, and what arrives and what the method averages are the
factors. Distances and norms are over the flattened update (all of a client's tensors, concatenated
in key order): a coordinated attack on one tensor shows in the client's whole vector.

* ``median`` — the coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates"): each entry the median of the K clients' entries (the mean of
  the two middle ones for even K).
* ``trimmed_mean`` — the coordinate-wise β-trimmed mean (ibid.): drop the ⌊βK⌋ largest and ⌊βK⌋
  smallest values of each entry, average the rest.
* ``krum`` / ``multi_krum`` (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
  Tolerant Gradient Descent"): client k's score is the sum of the squared distances to its
  K − f − 2 nearest other clients; Krum keeps the lowest-scoring client, Multi-Krum the m lowest
  (ties: the smaller index first). Needs K ≥ 2f + 3, and m ≤ K − f. Distances are exact at every K
  (differences, not the matrix-product formula ‖x‖² + ‖y‖² − 2x·y, which cancels catastrophically
  when the updates share a large common part). The kept clients' updates go to the method.
* ``norm_bound`` — each update scaled by min(1, B/‖Δ_k‖) (Sun et al. 2019, "Can You Really Backdoor
  Federated Learning?"); B a number, or ``median`` (the median of the round's update norms).

Each rule is an object (:data:`RULES` is the one registry) that states what it refuses
(:meth:`RobustRule.refusal`) and takes its part in the method's aggregation, as Flower's
``FedMedian`` and ``Krum`` strategies do in ``FedAvg``'s; the server's chain (``federation.chain``)
composes it, nothing is assigned onto the method:

* a coordinate-wise rule is the method's average: its centre is the mean the method is given
  (``AggregationContext.mean``), so it is defined only for methods whose aggregation is that
  average (``Capabilities.averages_uploads``); the uploads themselves are not edited;
* Krum and Multi-Krum select the updates the method aggregates; norm bounding shrinks them. Both
  apply to any method that exchanges parameters.

After a rule, the method weighs the kept clients by the example counts the server assigned them
(``ClientInfo.num_examples``), never by counts a client reports: a Byzantine client could report a
huge count and buy back the weight the rule took from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from fedsweep.algorithms.tensors import Params
from fedsweep.federation.update import Update
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


def squared_distances(updates: list[Params]) -> torch.Tensor:
    """(K, K) float64 ‖Δ_i − Δ_j‖², each from the difference itself (exact at every K: no cancellation)."""
    x = torch.stack([flatten(u) for u in updates])
    return torch.stack([(x - x[i]).square().sum(dim=1) for i in range(x.shape[0])])


def krum_scores(updates: list[Params], f: int) -> list[float]:
    """Client k's Krum score: the sum of its squared distances to its K − f − 2 nearest other clients."""
    k = len(updates)
    if k < 2 * f + 3:
        raise ValueError(f"Krum with f={f} needs at least 2f + 3 = {2 * f + 3} clients, the round has {k}")
    d = squared_distances(updates)
    scores = []
    for i in range(k):
        others = torch.cat([d[i, :i], d[i, i + 1:]]).sort().values
        scores.append(float(others[: k - f - 2].sum()))
    return scores


def krum(updates: list[Params], f: int, m: int = 1) -> list[int]:
    """The indices of the ``m`` lowest Krum scores (Krum: m = 1), ties to the smaller index."""
    if m > len(updates) - f:
        raise ValueError(f"Multi-Krum keeps m={m} of {len(updates)} updates with f={f}: m must be at most K − f")
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


# ------------------------------------------------------------------------------------------ rules
@dataclass
class Outcome:
    """What a rule hands on: the updates the method aggregates, the clients it left out, its scalars."""

    kept: list[Update]
    left_out: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RobustRule:
    """Base class: no rule (every update goes to the method as it came)."""

    name: ClassVar[str] = "none"
    coordinatewise: ClassVar[bool] = False

    @classmethod
    def of(cls, section) -> "RobustRule":
        """This rule with the settings of ``server.robust``."""
        return cls()

    def refusal(self, method: str, caps, per_round: int) -> str | None:
        """Why this rule cannot run ``method`` (its capabilities ``caps``) with ``per_round`` clients
        sampled a round; None when it can. One line, naming the field."""
        if self.coordinatewise and not caps.averages_uploads:
            return (f"server.robust.rule={self.name} replaces the method's average of the uploads by a "
                    f"coordinate-wise centre, and {method} does not aggregate by averaging them "
                    f"({_why_not_average(caps)}); use krum, multi_krum or norm_bound")
        return None

    def needs(self) -> int:
        """The fewest updates a round must keep for this rule to run."""
        return 1

    def apply(self, updates: list[Update]) -> Outcome:
        return Outcome(list(updates))

    def mean(self, sets: list[Params], weights) -> Params:  # coordinate-wise rules only
        """The centre the method uses in place of its weighted mean of ``sets``."""
        raise NotImplementedError


def _why_not_average(caps) -> str:
    if caps.personalized:
        return "personalised: it aggregates each client's own set"
    if caps.base_merges:
        return "it stacks the clients' factors"
    return "its aggregation is not a mean of what the clients sent"


@dataclass
class Median(RobustRule):
    name: ClassVar[str] = "median"
    coordinatewise: ClassVar[bool] = True

    def mean(self, sets, weights):
        """The coordinate-wise median of the sets (unweighted, as Yin et al. define it)."""
        return coordinate_median(sets)


@dataclass
class TrimmedMean(RobustRule):
    name: ClassVar[str] = "trimmed_mean"
    coordinatewise: ClassVar[bool] = True
    beta: float = 0.1

    @classmethod
    def of(cls, section):
        return cls(section.beta)

    def mean(self, sets, weights):
        """The coordinate-wise β-trimmed mean of the sets (unweighted)."""
        return trimmed_mean(sets, self.beta)


@dataclass
class Krum(RobustRule):
    name: ClassVar[str] = "krum"
    f: int = 1

    @classmethod
    def of(cls, section):
        return cls(section.f)

    def keep(self, k: int) -> int:
        return 1

    def needs(self) -> int:
        return 2 * self.f + 3

    def refusal(self, method, caps, per_round):
        if per_round < self.needs():
            return (f"server.robust.rule={self.name} with f={self.f} needs at least 2f + 3 = {self.needs()} "
                    f"clients a round; the round samples {per_round}")
        return None

    def apply(self, updates):
        keep = krum([u.delta for u in updates], self.f, self.keep(len(updates)))
        return Outcome([updates[i] for i in keep], [u.cid for i, u in enumerate(updates) if i not in keep])


@dataclass
class MultiKrum(Krum):
    name: ClassVar[str] = "multi_krum"
    m: int | None = None

    @classmethod
    def of(cls, section):
        return cls(section.f, section.m)

    def keep(self, k: int) -> int:
        """m, at most K − f of the K that arrived (dropout and deadlines can leave fewer than sampled)."""
        return min(self.m or k - self.f, k - self.f)

    def refusal(self, method, caps, per_round):
        if self.m is not None and self.m > per_round - self.f:
            return (f"server.robust.m={self.m}: Multi-Krum keeps at most K − f = {per_round} − {self.f} = "
                    f"{per_round - self.f} of the {per_round} clients a round samples (more would keep attackers)")
        return super().refusal(method, caps, per_round)


@dataclass
class NormBound(RobustRule):
    name: ClassVar[str] = "norm_bound"
    bound: float | str = "median"

    @classmethod
    def of(cls, section):
        return cls(section.bound)

    def apply(self, updates):
        deltas = [u.delta for u in updates]
        bound = median_norm(deltas) if self.bound == "median" else float(self.bound)
        clipped, scales = norm_bound(deltas, bound)
        return Outcome([u.with_delta(d) for u, d in zip(updates, clipped)],
                       metrics={"robust_clipped": float(sum(s < 1 for s in scales))})


RULES: dict[str, type[RobustRule]] = {r.name: r for r in (RobustRule, Median, TrimmedMean, Krum, MultiKrum, NormBound)}
"""The one registry of robust rules, by ``server.robust.rule`` (the schema's choices are its keys)."""


def rule_from(section) -> RobustRule:
    """The rule ``server.robust`` names, with its settings."""
    return RULES[section.rule].of(section)
