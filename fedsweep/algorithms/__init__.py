"""Federated methods as pure plugins (tensors in, tensors out). See base.Algorithm and docs/architecture.md."""

from fedsweep.algorithms import (  # noqa: F401  (register the plugins)
    centralized,
    drift,
    fedadagrad,
    fedadam,
    fedavg,
    fedavgm,
    fedcda,
    fedcofit,
    fedicu,
    fedit,
    fedprox,
    fedreft,
    fedsa_lora,
    fedyogi,
    ffa_lora,
    flexlora,
    flora,
    local,
    pfedgpt,
    scaffold,
)
from fedsweep.algorithms.base import Algorithm, Capabilities, HyperParams, NoParams
from fedsweep.algorithms.registry import capabilities, create, get, names, register
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import ClientResult, Payload, Report, ServerState, Upload

__all__ = ["Algorithm", "Capabilities", "ClientResult", "HyperParams", "NoParams", "Params", "Payload", "Report",
           "ServerState", "Upload", "capabilities", "create", "get", "names", "register"]
