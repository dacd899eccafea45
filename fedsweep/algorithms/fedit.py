"""FedIT (Zhang et al. 2024, "Towards Building the Federated GPT: Federated Instruction Tuning"):
FedAvg applied to the LoRA factors A and B, each averaged separately."""

from __future__ import annotations

from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.registry import register


@register
class FedIT(FedAvg):
    """FedAvg over LoRA factors: the same computation as ``fedavg``, kept as the name the papers use."""

    name = "fedit"
    summary = "FedAvg over LoRA factors (alias of fedavg)"
