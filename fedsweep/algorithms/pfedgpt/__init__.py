"""pFedGPT: per-client hierarchical Bayesian optimisation of local/global LoRA mixing.

``plugin`` (the method), ``space`` (the mixing weights and their search space), ``validation``
(per-client validation sets from the held-out pool), ``bayesopt`` (the GP minimiser)."""

from fedsweep.algorithms.pfedgpt.plugin import GLOBAL, INIT, PFedGPT, PFedGPTParams

__all__ = ["GLOBAL", "INIT", "PFedGPT", "PFedGPTParams"]
