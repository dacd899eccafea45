"""DRIFT: graph-based personalised LoRA aggregation (``plugin``) over a client graph (``graph``)."""

from fedsweep.algorithms.drift.plugin import Drift, DriftParams

__all__ = ["Drift", "DriftParams"]
