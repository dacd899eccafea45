"""FedCoFiT: semantic consensus over public-prompt responses (``plugin``), the consensus rule (``consensus``)."""

from fedsweep.algorithms.fedcofit.plugin import DPParams, FedCoFiT, FedCoFiTParams

__all__ = ["DPParams", "FedCoFiT", "FedCoFiTParams"]
