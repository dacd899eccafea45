"""What the federation steps refuse, and why: one line naming the field, at validation.

The robust rules state their own refusals (``RobustRule.refusal``); this module asks them, and adds
what holds for every step: a step that acts on exchanged parameters needs a method that exchanges
them (``Capabilities.exchanges_params``), the centralised reference federates nothing, updates of
different shapes (mixed LoRA ranks) cannot be compared by a rule, a rule needs the updates' starts
to be what the server sent (``Capabilities.start_sent``), and a compressed download needs one global
model sent to every client (``Capabilities.one_download``). An attack acts on the update from the
client's own start, so it needs nothing more.
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
    if down != "none" and (caps.personalized or caps.base_merges or not caps.one_download):
        what = ("each client its own parameters" if caps.personalized else "factors merged into the base"
                if caps.base_merges else "each client the global model cut to its own rank")
        return (f"server.download.compression={down}: {method} sends {what}, not one global model the clients "
                f"keep a replica of")
    if rule != "none" and any(len(set(r or ())) > 1 for r in (cfg.lora.rank_choices, cfg.lora.ranks)):
        return (f"server.robust.rule={rule}: clients with different LoRA ranks send updates of different "
                f"shapes, which no robust rule compares")
    why = rule_from(cfg.server.robust).refusal(method, caps, cfg.clients.per_round)
    if why is None and rule != "none" and not caps.start_sent:
        why = (f"server.robust.rule={rule}: {method}'s clients start from adapters the server never sent "
               f"(fresh ones, or their own), so the server cannot form their updates θ_k − θ_start and a rule "
               f"would judge whole adapters")
    return why
