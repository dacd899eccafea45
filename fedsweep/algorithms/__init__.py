"""Federated methods as pure plugins (tensors in, tensors out). See base.Algorithm."""

from fedsweep.algorithms import (  # noqa: F401  (register the plugins)
    centralized,
    drift,
    fedavg,
    fedcda,
    fedcofit,
    fedicu,
    fedopt,
    fedreft,
    fedprox,
    flexlora,
    flora,
    local,
    pfedgpt,
    lora_variants,
    scaffold,
)
from fedsweep.algorithms.base import Algorithm, ClientResult, Params, Payload, Report, ServerState, Upload
from fedsweep.algorithms.registry import create, get, names, register

__all__ = ["Algorithm", "ClientResult", "Params", "Payload", "Report", "ServerState", "Upload",
           "create", "get", "names", "register"]
