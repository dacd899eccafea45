"""What the federation steps refuse, and why: one line naming the field, at validation.

The robust rules state their own refusals (``RobustRule.refusal``); this module asks them, and adds
what holds for every step: a step that acts on exchanged parameters needs a method that exchanges
them (``Capabilities.exchanges_params``), the centralised reference federates nothing, updates of
different shapes (mixed LoRA ranks) cannot be compared by a rule, and a compressed download needs
one global model sent to every client.
"""

from __future__ import annotations

from fedsweep.federation.robust import rule_from


def refusal(cfg, method: str, caps) -> str | None:
    """Why ``cfg``'s federation settings cannot run ``method`` (capabilities ``caps``); None if they can."""
    rule, up, down = cfg.server.robust.rule, cfg.clients.upload.compression, cfg.server.download.compression
    attacked = bool(cfg.clients.byzantine.fraction)
    if caps.centralized and (rule != "none" or attacked or up != "none" or down != "none"):
        return (f"server.robust / server.download / clients.byzantine / clients.upload: {method} is the "
                f"centralised reference (one client trains on all data; nothing is federated)")
    if not caps.exchanges_params:
        for field, on in (("server.robust.rule", rule != "none"), ("clients.upload.compression", up != "none"),
                          ("server.download.compression", down != "none"), ("clients.byzantine", attacked)):
            if on:
                return f"{field}: {method} exchanges no parameters (it uploads no parameters to compress, attack or screen)"
    if down != "none" and (caps.personalized or caps.base_merges):
        return (f"server.download.compression={down}: {method} sends "
                f"{'each client its own parameters' if caps.personalized else 'factors merged into the base'}, "
                f"not one global model the clients keep a replica of")
    if rule != "none" and any(len(set(r or ())) > 1 for r in (cfg.lora.rank_choices, cfg.lora.ranks)):
        return (f"server.robust.rule={rule}: clients with different LoRA ranks send updates of different "
                f"shapes, which no robust rule compares")
    return rule_from(cfg.server.robust).refusal(method, caps, cfg.clients.per_round)
